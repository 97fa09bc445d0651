//! Forming a `tcp` world: the rendezvous store served by rank 0, then the full mesh.
//!
//! 1. Every rank binds a data listener on port 0 and connects to rank 0's store at
//!    `MASTER_ADDR:MASTER_PORT`, retrying with backoff until the store answers (rank 0 may start
//!    last). The store sends a fresh random challenge; the rank answers with its registration
//!    `(rank, world size, data address, its own challenge)` and, when the job has a token, an
//!    HMAC of the registration and the store's challenge (see [`super::auth`]).
//! 2. Rank 0 serves every connection at once (a silent or slow one delays nobody) and drops,
//!    with a log line, any that sends garbage, says nothing within [`MESSAGE_WAIT`], or fails
//!    the HMAC (a wrong token, a replayed message); such a process is told `Rejected` and the
//!    job goes on. An authenticated registration is then validated: a different world size, a
//!    rank out of range or a rank claimed twice is refused, with a message sent to the offender
//!    and to every rank already registered, and rank 0 fails too. Once every rank has
//!    registered, rank 0 sends the address table and a random session number to all, with an
//!    HMAC over each rank's own challenge.
//! 3. Every rank dials the data listeners of the higher ranks and, at the same time (another
//!    thread), accepts the lower ones. The accepting side sends a challenge; the dialer answers
//!    with a hello (session, world size, both ranks, its own challenge, HMAC); the accepting
//!    side checks it and answers with its own HMAC. A stray connection is dropped and logged.
//!
//! 4. With rejoining on ([`super::TcpConfig::rejoin`], checked to be the same on every rank),
//!    rank 0 keeps serving the store ([`serve_running_store`]) and every rank keeps accepting on
//!    its data listener ([`serve_rejoin_dials`]) once the world is formed. A restarted rank's
//!    registration is answered at once with [`Reply::Running`]: the address table (updated
//!    with the new address), the session and each rank's [`RankState`] as rank 0 sees it; the
//!    restarted rank dials the ranks that are up or joining with the same handshake as step 3
//!    ([`dial_until`]), and a rank accepts it in place of a failed connection.
//!
//! A rank whose registrations are all rejected (its token differs from rank 0's) keeps trying
//! until the rendezvous timeout, then fails with [`CollectiveError::JobToken`]. A job token on
//! one side of the rendezvous and none on the other fails at once with that error.
//!
//! Every step is bounded by the one deadline of [`super::TcpConfig::timeout`].

use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::auth::{JOB_TOKEN_ENV, JobToken, NONCE_LEN, Nonce, TAG_LEN, Tag, random_bytes};
use crate::error::{CollectiveError, Result};

/// Tags the messages of the rendezvous store.
const STORE_MAGIC: &[u8; 4] = b"BPRV";
/// Tags the challenge of a data connection.
const CHALLENGE_MAGIC: &[u8; 4] = b"BPHC";
/// Tags the dialer's hello of a data connection.
const HELLO_MAGIC: &[u8; 4] = b"BPHS";
/// Tags the accepting side's answer of a data connection.
const ANSWER_MAGIC: &[u8; 4] = b"BPHA";
/// Version of the rendezvous protocol (2: challenges and job-token HMACs).
const PROTOCOL: u8 = 2;
/// Largest store message accepted.
const MAX_STORE_MESSAGE: u32 = 16 << 20;
/// Longest wait for one message of a process that has connected.
const MESSAGE_WAIT: Duration = Duration::from_secs(5);
/// Most connections waiting for their first message at once; more wait in the listener's
/// backlog until some are heard or dropped.
const MAX_PENDING: usize = 1024;
/// Most dropped connections reported one by one on stderr; the rest are counted.
const MAX_LOGGED: usize = 16;

/// HMAC labels, one per message.
const REGISTER_LABEL: &str = "burn-parallel/rendezvous/v2/register";
const ACCEPTED_LABEL: &str = "burn-parallel/rendezvous/v2/accepted";
const REFUSED_LABEL: &str = "burn-parallel/rendezvous/v2/refused";
const RUNNING_LABEL: &str = "burn-parallel/rendezvous/v2/running";
const HELLO_LABEL: &str = "burn-parallel/mesh/v2/hello";
const ANSWER_LABEL: &str = "burn-parallel/mesh/v2/answer";

/// The store's first message on every connection.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Challenge {
    nonce: Nonce,
    /// Whether rank 0 has a job token (and so expects an HMAC).
    authenticated: bool,
}

/// What a rank tells rank 0.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Registration {
    rank: usize,
    world_size: usize,
    data_addr: SocketAddr,
    pid: u32,
    /// The rank's challenge to the store, answered by the HMAC of the reply.
    nonce: Nonce,
    /// HMAC over the store's challenge and the fields above (job token only).
    tag: Option<Tag>,
    /// Whether the rank was started with rejoining on ([`super::TcpConfig::rejoin`]); every
    /// rank of a job must agree. Absent (false) from builds that predate it.
    #[serde(default)]
    rejoin: bool,
}

impl Registration {
    fn tag_parts<'a>(&self, challenge: &'a Nonce, buf: &'a mut Vec<u8>) -> [&'a [u8]; 2] {
        buf.clear();
        buf.extend_from_slice(&(self.rank as u64).to_le_bytes());
        buf.extend_from_slice(&(self.world_size as u64).to_le_bytes());
        buf.extend_from_slice(&self.pid.to_le_bytes());
        buf.extend_from_slice(&self.nonce);
        buf.extend_from_slice(self.data_addr.to_string().as_bytes());
        if self.rejoin {
            buf.extend_from_slice(b"/rejoin");
        }
        [challenge, buf]
    }
}

/// Rank 0's answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum Reply {
    /// The world is formed: the data address of every rank and the session number.
    Accepted {
        session: u64,
        addrs: Vec<SocketAddr>,
        tag: Option<Tag>,
    },
    /// The world cannot be formed.
    Refused { reason: String, tag: Option<Tag> },
    /// This registration was not authenticated; the job goes on without this connection.
    Rejected { reason: String },
    /// The world is already running (the registration is a restarted rank's): the data
    /// address of every rank, the session number and what rank 0 knows of each rank.
    Running {
        session: u64,
        addrs: Vec<SocketAddr>,
        states: Vec<RankState>,
        tag: Option<Tag>,
    },
}

/// What rank 0's store tells a restarted rank about each rank of a running world.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum RankState {
    /// Connected to rank 0 and healthy: the restarted rank dials it.
    Up,
    /// Restarted and registered before this one, not yet connected to rank 0: its address is
    /// fresh, the restarted rank dials it.
    Joining,
    /// Failed and not restarted (its address is stale): it dials the restarted rank when it
    /// registers in turn.
    Down,
}

impl RankState {
    fn byte(self) -> u8 {
        match self {
            RankState::Up => b'u',
            RankState::Joining => b'j',
            RankState::Down => b'd',
        }
    }
}

fn running_parts(session: u64, addrs: &[SocketAddr], states: &[RankState]) -> Vec<u8> {
    let mut buf = accepted_parts(session, addrs);
    buf.extend(states.iter().map(|s| s.byte()));
    buf
}

/// What registering with rank 0's store gave.
pub(crate) enum Joined {
    /// The world is being formed: every rank got the same table.
    Forming {
        session: u64,
        addrs: Vec<SocketAddr>,
    },
    /// The world was already running: this is a restarted rank.
    Running {
        session: u64,
        addrs: Vec<SocketAddr>,
        states: Vec<RankState>,
    },
}

fn accepted_parts(session: u64, addrs: &[SocketAddr]) -> Vec<u8> {
    let mut buf = session.to_le_bytes().to_vec();
    for addr in addrs {
        buf.extend_from_slice(addr.to_string().as_bytes());
        buf.push(b',');
    }
    buf
}

/// What the rendezvous produces: one connected socket per peer (`None` at this rank's index).
pub(crate) type Mesh = Vec<Option<TcpStream>>;

fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

/// A read or write timeout no longer than `cap` and never zero (zero means "no timeout").
fn bounded(deadline: Instant, cap: Duration) -> Duration {
    remaining(deadline).min(cap).max(Duration::from_millis(1))
}

fn encode_message(value: &impl Serialize) -> io::Result<Vec<u8>> {
    let body = serde_json::to_vec(value).map_err(io::Error::other)?;
    let mut buf = Vec::with_capacity(9 + body.len());
    buf.extend_from_slice(STORE_MAGIC);
    buf.push(PROTOCOL);
    buf.extend_from_slice(&(body.len() as u32).to_le_bytes());
    buf.extend_from_slice(&body);
    Ok(buf)
}

fn send_message(stream: &mut TcpStream, value: &impl Serialize) -> io::Result<()> {
    stream.write_all(&encode_message(value)?)?;
    stream.flush()
}

fn invalid(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what)
}

/// Checks the 9-byte head of a store message; returns the length of its body.
fn check_head(head: &[u8]) -> io::Result<usize> {
    if &head[..4] != STORE_MAGIC {
        return Err(invalid(
            "not a burn-parallel rendezvous message (is another service using MASTER_PORT?)".into(),
        ));
    }
    if head[4] != PROTOCOL {
        return Err(invalid(format!(
            "rendezvous protocol version {} (this build speaks {PROTOCOL}): mixed builds?",
            head[4]
        )));
    }
    let len = u32::from_le_bytes(head[5..9].try_into().expect("4 bytes"));
    if len > MAX_STORE_MESSAGE {
        return Err(invalid(format!("rendezvous message of {len} bytes")));
    }
    Ok(len as usize)
}

fn decode<T: DeserializeOwned>(body: &[u8]) -> io::Result<T> {
    serde_json::from_slice(body).map_err(|e| invalid(format!("garbled rendezvous message: {e}")))
}

fn recv_message<T: DeserializeOwned>(stream: &mut TcpStream) -> io::Result<T> {
    let mut head = [0u8; 9];
    stream.read_exact(&mut head)?;
    let len = check_head(&head)?;
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body)?;
    decode(&body)
}

/// A random number identifying one world, so that connections from another job are refused.
fn new_session() -> Result<u64> {
    random_bytes::<8>().map(u64::from_le_bytes)
}

/// A connection accepted by a non-blocking listener, waiting for its first message.
struct Pending {
    stream: TcpStream,
    from: SocketAddr,
    /// The challenge sent on it.
    nonce: Nonce,
    buf: Vec<u8>,
    since: Instant,
}

/// Whether a [`Pending`] connection's message is complete.
enum Progress {
    /// More bytes are needed.
    Waiting,
    /// The whole message (for a store message, its body).
    Done(Vec<u8>),
}

impl Pending {
    /// Reads what has arrived, without blocking, until `need(buf)` bytes are there;
    /// `need` gives the total length of the message from what was read so far.
    fn poll(&mut self, need: impl Fn(&[u8]) -> io::Result<usize>) -> io::Result<Progress> {
        loop {
            let want = need(&self.buf)?;
            if self.buf.len() == want {
                return Ok(Progress::Done(std::mem::take(&mut self.buf)));
            }
            let have = self.buf.len();
            self.buf.resize(want, 0);
            match self.stream.read(&mut self.buf[have..]) {
                Ok(0) => {
                    self.buf.truncate(have);
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!("closed the connection after {have} bytes"),
                    ));
                }
                Ok(n) => self.buf.truncate(have + n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.buf.truncate(have);
                    return Ok(Progress::Waiting);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => self.buf.truncate(have),
                Err(e) => return Err(e),
            }
        }
    }
}

/// The length of a store message given its first bytes.
fn store_message_len(buf: &[u8]) -> io::Result<usize> {
    if buf.len() < 9 {
        Ok(9)
    } else {
        Ok(9 + check_head(&buf[..9])?)
    }
}

/// The connections a listener dropped: logged on stderr (the first [`MAX_LOGGED`]) and kept
/// for the error message of a rendezvous that fails.
struct Dropped {
    rank: usize,
    what: &'static str,
    reasons: Vec<String>,
    count: usize,
    token_rejections: usize,
}

impl Dropped {
    fn new(rank: usize, what: &'static str) -> Self {
        Self {
            rank,
            what,
            reasons: Vec::new(),
            count: 0,
            token_rejections: 0,
        }
    }

    fn record(&mut self, from: SocketAddr, why: impl std::fmt::Display) {
        self.count += 1;
        if self.count <= MAX_LOGGED {
            let line = format!("{from}: {why}");
            eprintln!(
                "burn-parallel rank {}: dropped a connection to {}: {line}",
                self.rank, self.what
            );
            self.reasons.push(line);
        } else if self.count == MAX_LOGGED + 1 {
            eprintln!(
                "burn-parallel rank {}: more connections to {} dropped; not logging them",
                self.rank, self.what
            );
        }
    }

    /// "; ignored connections: ..." for an error message, or nothing.
    fn summary(&self) -> String {
        if self.count == 0 {
            return String::new();
        }
        let mut s = format!(
            "; {} connection(s) ignored: {}",
            self.count,
            self.reasons.join("; ")
        );
        if self.count > self.reasons.len() {
            s.push_str("; ...");
        }
        if self.token_rejections > 0 {
            s.push_str(&format!(
                " ({} registration(s) failed the job-token check: is a rank started with \
                 another {JOB_TOKEN_ENV}?)",
                self.token_rejections
            ));
        }
        s
    }
}

/// Longest a listener's loop waits for news, so that it sees its deadline, its stop flag and
/// the silent connections to drop.
const POLL_CAP: Duration = Duration::from_millis(50);

/// Waits until `listener` has a connection to accept or a `pending` connection has bytes
/// (or is closed), at most `timeout` (and [`POLL_CAP`]).
#[cfg(unix)]
fn wait_readable(listener: &TcpListener, pending: &[Pending], timeout: Duration) {
    use std::os::fd::AsRawFd;
    // A full pending list accepts nothing: wait for the pending connections only.
    let listening = (pending.len() < MAX_PENDING).then(|| listener.as_raw_fd());
    let mut fds: Vec<libc::pollfd> = listening
        .into_iter()
        .chain(pending.iter().map(|p| p.stream.as_raw_fd()))
        .map(|fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let ms = timeout.min(POLL_CAP).as_millis().max(1) as libc::c_int;
    // SAFETY: `fds` is an array of `fds.len()` initialised pollfd structs that lives across
    // the call; the descriptors belong to `listener` and `pending`, borrowed for the call. An
    // error (EINTR) only ends the wait early, which the caller's loop tolerates.
    unsafe {
        libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms);
    }
}

/// Without poll(2): a short sleep.
#[cfg(not(unix))]
fn wait_readable(_listener: &TcpListener, _pending: &[Pending], timeout: Duration) {
    thread::sleep(timeout.min(Duration::from_millis(1)));
}

/// Accepts every connection waiting on the non-blocking `listener` and sends each
/// `challenge(nonce)`; returns whether any arrived.
fn accept_pending(
    listener: &TcpListener,
    pending: &mut Vec<Pending>,
    dropped: &mut Dropped,
    challenge: impl Fn(&Nonce) -> io::Result<Vec<u8>>,
) -> io::Result<bool> {
    let mut any = false;
    while pending.len() < MAX_PENDING {
        let (mut stream, from) = match listener.accept() {
            Ok(accepted) => accepted,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(any),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted
                ) =>
            {
                continue;
            }
            // Out of descriptors or memory (a flood of connections?): leave the rest in the
            // backlog until pending ones are heard or dropped.
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
                ) && !pending.is_empty() =>
            {
                // The listener stays readable meanwhile: do not spin on it.
                thread::sleep(Duration::from_millis(5));
                return Ok(any);
            }
            Err(e) => return Err(e),
        };
        any = true;
        let nonce: Nonce = match random_bytes() {
            Ok(n) => n,
            Err(e) => return Err(io::Error::other(e.to_string())),
        };
        // A fresh socket's send buffer is empty: this small write does not block.
        let sent = stream
            .set_nonblocking(false)
            .and_then(|()| stream.set_write_timeout(Some(MESSAGE_WAIT)))
            .and_then(|()| stream.write_all(&challenge(&nonce)?))
            .and_then(|()| stream.set_nonblocking(true));
        match sent {
            Ok(()) => pending.push(Pending {
                stream,
                from,
                nonce,
                buf: Vec::new(),
                since: Instant::now(),
            }),
            Err(e) => dropped.record(from, format!("cannot send the challenge: {e}")),
        }
    }
    Ok(any)
}

/// Binds a listener on port 0 of `ip` (the interface that reaches rank 0).
pub(crate) fn bind_data_listener(ip: IpAddr) -> Result<TcpListener> {
    TcpListener::bind(SocketAddr::new(ip, 0)).map_err(|e| {
        CollectiveError::Rendezvous(format!("cannot open a data listener on {ip}: {e}"))
    })
}

/// Connects to `host:port`, retrying with backoff (rank 0 may not listen yet) until `deadline`.
pub(crate) fn connect_with_retry(
    host: &str,
    port: u16,
    deadline: Instant,
    what: &str,
) -> Result<TcpStream> {
    let mut backoff = Duration::from_millis(10);
    let mut last_error = String::from("no attempt was made");
    loop {
        match (host, port).to_socket_addrs() {
            Ok(addrs) => {
                for addr in addrs {
                    match TcpStream::connect_timeout(
                        &addr,
                        bounded(deadline, Duration::from_secs(2)),
                    ) {
                        Ok(stream) => return Ok(stream),
                        Err(e) => last_error = format!("{addr}: {e}"),
                    }
                }
            }
            Err(e) => last_error = format!("cannot resolve {host:?}: {e}"),
        }
        let left = remaining(deadline);
        if left.is_zero() {
            return Err(CollectiveError::Rendezvous(format!(
                "could not connect to {what} at {host}:{port} before the rendezvous timeout \
                 (last error: {last_error})"
            )));
        }
        // One last attempt at the deadline.
        thread::sleep(backoff.min(left));
        backoff = (backoff * 2).min(Duration::from_millis(500));
    }
}

/// The messages complete on `pending` connections (`need` gives a message's length from its
/// first bytes), each with its connection; a connection that fails, or sends no `what` within
/// [`MESSAGE_WAIT`], is dropped and recorded; the others stay pending. The store's
/// registrations and the data listeners' hellos are read through it.
fn ready_messages(
    pending: &mut Vec<Pending>,
    need: impl Fn(&[u8]) -> io::Result<usize>,
    what: &str,
    dropped: &mut Dropped,
) -> Vec<(Pending, Vec<u8>)> {
    let mut ready = Vec::new();
    let mut i = 0;
    while i < pending.len() {
        match pending[i].poll(&need) {
            Ok(Progress::Waiting) if pending[i].since.elapsed() < MESSAGE_WAIT => i += 1,
            Ok(Progress::Waiting) => {
                let p = pending.swap_remove(i);
                dropped.record(p.from, format!("sent no {what} within {MESSAGE_WAIT:?}"));
            }
            Err(e) => {
                let p = pending.swap_remove(i);
                dropped.record(p.from, e);
            }
            Ok(Progress::Done(message)) => ready.push((pending.swap_remove(i), message)),
        }
    }
    ready
}

/// Decodes and authenticates the registration `body` that arrived on `pending`; returns the
/// (now blocking) stream, the peer address and the registration, or `None` after telling the
/// sender `Rejected` and logging it (the job goes on without this connection).
fn authenticate(
    pending: Pending,
    body: &[u8],
    token: Option<&JobToken>,
    dropped: &mut Dropped,
) -> Option<(TcpStream, SocketAddr, Registration)> {
    let Pending {
        mut stream,
        from,
        nonce,
        ..
    } = pending;
    let registration = match decode::<Registration>(&body[9..]) {
        Ok(r) => r,
        Err(e) => {
            dropped.record(from, e);
            return None;
        }
    };
    // Authenticate before believing anything the registration says.
    let mut buf = Vec::new();
    let rejection = match (token, registration.tag) {
        (Some(token), Some(tag)) => (!token.verify(
            REGISTER_LABEL,
            &registration.tag_parts(&nonce, &mut buf),
            &tag,
        ))
        .then_some("wrong job token (the HMAC of the challenge does not match)"),
        (Some(_), None) => Some("no job token, but this job has one"),
        (None, Some(_)) => Some("a job token, but rank 0 has none"),
        (None, None) => None,
    };
    if let Some(why) = rejection {
        if registration.tag.is_some() && token.is_some() {
            dropped.token_rejections += 1;
        }
        let _ = stream.set_nonblocking(false).and_then(|()| {
            send_message(
                &mut stream,
                &Reply::Rejected {
                    reason: why.to_string(),
                },
            )
        });
        dropped.record(
            from,
            format!(
                "registration claiming rank {} rejected: {why}",
                registration.rank
            ),
        );
        return None;
    }
    if let Err(e) = stream.set_nonblocking(false) {
        dropped.record(from, e);
        return None;
    }
    Some((stream, from, registration))
}

/// How a rejoining store names a rank's rejoin flag in its errors.
fn rejoin_setting(on: bool) -> &'static str {
    if on {
        "rejoining on (BURN_PARALLEL_FAULT_TOLERANT=1, TcpConfig::rejoin)"
    } else {
        "rejoining off (BURN_PARALLEL_FAULT_TOLERANT unset or 0, TcpConfig::rejoin false)"
    }
}

/// A registered rank, as rank 0 keeps it.
struct Registered {
    stream: TcpStream,
    registration: Registration,
    from: SocketAddr,
}

/// Rank 0's side of steps 1 and 2: serves the store on `store` until every rank has
/// registered. Returns the session number and the address table.
#[allow(clippy::too_many_arguments)]
pub(crate) fn serve_store(
    store: &TcpListener,
    world_size: usize,
    own_data_addr: SocketAddr,
    token: Option<&JobToken>,
    rejoin: bool,
    deadline: Instant,
    timeout: Duration,
) -> Result<(u64, Vec<SocketAddr>)> {
    let store_addr = store
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "MASTER_ADDR:MASTER_PORT".into());
    store
        .set_nonblocking(true)
        .map_err(|e| CollectiveError::Rendezvous(format!("rendezvous listener: {e}")))?;
    let mut registered: Vec<Option<Registered>> = (0..world_size).map(|_| None).collect();
    let mut missing = world_size - 1;
    let mut pending: Vec<Pending> = Vec::new();
    let mut dropped = Dropped::new(0, "the rendezvous store");

    // Refuses the world: tells every registered rank (and the offender) why, then fails.
    let refuse = |registered: &mut Vec<Option<Registered>>,
                  offender: Option<(&mut TcpStream, &Nonce)>,
                  reason: String| {
        let reason = format!("rank 0 could not form the world: {reason}");
        let reply = |nonce: &Nonce| Reply::Refused {
            reason: reason.clone(),
            tag: token.map(|t| t.tag(REFUSED_LABEL, &[nonce, reason.as_bytes()])),
        };
        if let Some((stream, nonce)) = offender {
            let _ = send_message(stream, &reply(nonce));
        }
        for r in registered.iter_mut().flatten() {
            let _ = send_message(&mut r.stream, &reply(&r.registration.nonce));
        }
        CollectiveError::Rendezvous(reason)
    };

    while missing > 0 {
        if Instant::now() >= deadline {
            let waiting: Vec<usize> = (1..world_size)
                .filter(|&r| registered[r].is_none())
                .collect();
            let reason = format!(
                "timed out after {timeout:?} waiting for rank(s) {waiting:?} of a world of \
                 {world_size} to register at {store_addr} (are they started, with MASTER_ADDR \
                 and MASTER_PORT pointing at rank 0, and the same WORLD_SIZE?){}",
                dropped.summary()
            );
            return Err(refuse(&mut registered, None, reason));
        }
        let challenge = |nonce: &Nonce| {
            encode_message(&Challenge {
                nonce: *nonce,
                authenticated: token.is_some(),
            })
        };
        let mut progressed =
            accept_pending(store, &mut pending, &mut dropped, challenge).map_err(|e| {
                refuse(
                    &mut registered,
                    None,
                    format!("accepting on {store_addr} failed: {e}"),
                )
            })?;

        let ready = ready_messages(
            &mut pending,
            store_message_len,
            "registration",
            &mut dropped,
        );
        progressed |= !ready.is_empty();
        for (p, body) in ready {
            let Some((mut stream, from, registration)) =
                authenticate(p, &body, token, &mut dropped)
            else {
                continue;
            };
            let r = registration.rank;
            let offender = Some((&mut stream, &registration.nonce));
            if registration.world_size != world_size {
                return Err(refuse(
                    &mut registered,
                    offender,
                    format!(
                        "rank {r} (at {from}, pid {}) was started with WORLD_SIZE={} but rank 0 \
                         with WORLD_SIZE={world_size}; start every rank with the same WORLD_SIZE",
                        registration.pid, registration.world_size
                    ),
                ));
            }
            if registration.rejoin != rejoin {
                return Err(refuse(
                    &mut registered,
                    offender,
                    format!(
                        "rank {r} (at {from}, pid {}) was started with {} but rank 0 with {}; \
                         start every rank with the same BURN_PARALLEL_FAULT_TOLERANT",
                        registration.pid,
                        rejoin_setting(registration.rejoin),
                        rejoin_setting(rejoin)
                    ),
                ));
            }
            if r >= world_size {
                return Err(refuse(
                    &mut registered,
                    offender,
                    format!(
                        "rank {r} (at {from}, pid {}) is out of range for \
                         WORLD_SIZE={world_size}; RANK must be in 0..{world_size}",
                        registration.pid
                    ),
                ));
            }
            if r == 0 {
                return Err(refuse(
                    &mut registered,
                    offender,
                    format!(
                        "a second process (at {from}, pid {}) claims rank 0, but rank 0 is the \
                         process serving the rendezvous at {store_addr} (pid {}); every process \
                         needs a distinct RANK",
                        registration.pid,
                        std::process::id()
                    ),
                ));
            }
            if let Some(first) = &registered[r] {
                let reason = format!(
                    "rank {r} is claimed by two processes (at {}, pid {}, and at {from}, pid \
                     {}); every process needs a distinct RANK in 0..{world_size}",
                    first.from, first.registration.pid, registration.pid
                );
                return Err(refuse(&mut registered, offender, reason));
            }
            registered[r] = Some(Registered {
                stream,
                registration,
                from,
            });
            missing -= 1;
        }
        if !progressed {
            wait_readable(store, &pending, remaining(deadline));
        }
    }
    drop(pending);

    let session = new_session()?;
    let mut addrs = vec![own_data_addr];
    addrs.extend(registered.iter().skip(1).map(|r| {
        r.as_ref()
            .expect("every rank registered")
            .registration
            .data_addr
    }));
    let signed = accepted_parts(session, &addrs);
    for (rank, entry) in registered.iter_mut().enumerate().skip(1) {
        let r = entry.as_mut().expect("every rank registered");
        let reply = Reply::Accepted {
            session,
            addrs: addrs.clone(),
            tag: token.map(|t| t.tag(ACCEPTED_LABEL, &[&r.registration.nonce, &signed])),
        };
        r.stream
            .set_write_timeout(Some(bounded(deadline, MESSAGE_WAIT)))
            .and_then(|()| send_message(&mut r.stream, &reply))
            .map_err(|e| {
                CollectiveError::Rendezvous(format!(
                    "rank {rank} (at {}) registered but could not be sent the address table: {e}",
                    r.from
                ))
            })?;
    }
    Ok((session, addrs))
}

/// What rank 0's store keeps serving once the world runs with rejoining on.
pub(crate) struct RunningStore<'a> {
    /// The store's listener (`MASTER_ADDR:MASTER_PORT`).
    pub store: &'a TcpListener,
    pub world_size: usize,
    pub token: Option<&'a JobToken>,
    pub session: u64,
    /// The data address of every rank, updated as ranks rejoin.
    pub addrs: Vec<SocketAddr>,
    /// How long a rank that registered counts as joining (the rendezvous timeout).
    pub join_window: Duration,
    /// Ends the loop.
    pub stop: &'a AtomicBool,
}

/// Rank 0's store once the world is formed, with rejoining on: serves until `stop` is set.
/// An authenticated registration of a rank that `up` says is not healthy is answered with the
/// current address table ([`Reply::Running`]); any other registration is refused with a
/// reason, and the job goes on.
pub(crate) fn serve_running_store(mut running: RunningStore<'_>, up: &dyn Fn(usize) -> bool) {
    let RunningStore {
        store,
        world_size,
        token,
        session,
        join_window,
        stop,
        ..
    } = running;
    let store_addr = store
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "MASTER_ADDR:MASTER_PORT".into());
    if let Err(e) = store.set_nonblocking(true) {
        eprintln!(
            "burn-parallel rank 0: the rendezvous store stops, restarted ranks cannot rejoin: {e}"
        );
        return;
    }
    let mut joining: Vec<Option<Instant>> = vec![None; world_size];
    let mut pending: Vec<Pending> = Vec::new();
    let mut dropped = Dropped::new(0, "the rendezvous store");
    let challenge = |nonce: &Nonce| {
        encode_message(&Challenge {
            nonce: *nonce,
            authenticated: token.is_some(),
        })
    };
    while !stop.load(Ordering::Relaxed) {
        // A rank that connected to rank 0 is no longer joining.
        for (rank, mark) in joining.iter_mut().enumerate() {
            if mark.is_some() && up(rank) {
                *mark = None;
            }
        }
        let mut progressed = match accept_pending(store, &mut pending, &mut dropped, challenge) {
            Ok(any) => any,
            Err(e) => {
                eprintln!(
                    "burn-parallel rank 0: accepting on the rendezvous store {store_addr} \
                     failed, restarted ranks cannot rejoin: {e}"
                );
                return;
            }
        };
        let ready = ready_messages(
            &mut pending,
            store_message_len,
            "registration",
            &mut dropped,
        );
        progressed |= !ready.is_empty();
        for (p, body) in ready {
            let Some((mut stream, from, registration)) =
                authenticate(p, &body, token, &mut dropped)
            else {
                continue;
            };
            let r = registration.rank;
            let pid = registration.pid;
            let refusal = if registration.world_size != world_size {
                Some(format!(
                    "it was started with WORLD_SIZE={} but the running job has \
                     WORLD_SIZE={world_size}",
                    registration.world_size
                ))
            } else if r >= world_size {
                Some(format!(
                    "rank {r} is out of range for WORLD_SIZE={world_size}; RANK must be in \
                     0..{world_size}"
                ))
            } else if !registration.rejoin {
                Some(format!(
                    "the job is already running, and this process was started with {}: a \
                     restarted rank needs BURN_PARALLEL_FAULT_TOLERANT=1 like the rest of the job",
                    rejoin_setting(false)
                ))
            } else if r == 0 {
                Some(format!(
                    "rank 0 cannot be replaced: it is the process serving the rendezvous at \
                     {store_addr} (pid {}), and it is still running; once rank 0 is lost, no \
                     rank can rejoin (restart the whole job)",
                    std::process::id()
                ))
            } else if up(r) {
                Some(format!(
                    "rank {r} is still running in this job (rank 0 is connected to it and \
                     sees it healthy); start a process for rank {r} only once the old one has \
                     exited"
                ))
            } else {
                None
            };
            let reply = match refusal {
                Some(reason) => {
                    let reason = format!("rank 0 refused to let this process rejoin: {reason}");
                    dropped.record(
                        from,
                        format!("registration claiming rank {r} (pid {pid}) refused: {reason}"),
                    );
                    Reply::Refused {
                        tag: token.map(|t| {
                            t.tag(REFUSED_LABEL, &[&registration.nonce, reason.as_bytes()])
                        }),
                        reason,
                    }
                }
                None => {
                    running.addrs[r] = registration.data_addr;
                    joining[r] = Some(Instant::now());
                    let states: Vec<RankState> = (0..world_size)
                        .map(|k| match joining[k] {
                            _ if k == 0 || (k != r && up(k)) => RankState::Up,
                            Some(at) if k != r && at.elapsed() < join_window => RankState::Joining,
                            _ => RankState::Down,
                        })
                        .collect();
                    let signed = running_parts(session, &running.addrs, &states);
                    eprintln!(
                        "burn-parallel rank 0: rank {r} (pid {pid}, at {from}) rejoins the \
                         running job"
                    );
                    Reply::Running {
                        session,
                        addrs: running.addrs.clone(),
                        states,
                        tag: token.map(|t| t.tag(RUNNING_LABEL, &[&registration.nonce, &signed])),
                    }
                }
            };
            if let Err(e) = stream
                .set_write_timeout(Some(MESSAGE_WAIT))
                .and_then(|()| send_message(&mut stream, &reply))
            {
                dropped.record(from, format!("cannot answer its registration: {e}"));
            }
        }
        if !progressed {
            wait_readable(store, &pending, POLL_CAP);
        }
    }
}

/// The store client of a rank other than 0: connects to rank 0 (retrying until `deadline`),
/// binds this rank's data listener on the interface that reaches rank 0, answers the store's
/// challenge with its registration, and waits for the address table. A registration rejected
/// for its job token is retried (a new connection, a new challenge) until `deadline`. With
/// `rejoin`, a store whose world is already running answers at once ([`Joined::Running`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn register(
    rank: usize,
    world_size: usize,
    master_addr: &str,
    master_port: u16,
    token: Option<&JobToken>,
    rejoin: bool,
    deadline: Instant,
    timeout: Duration,
) -> Result<(TcpListener, Joined)> {
    let mut listener: Option<TcpListener> = None;
    let mut rejected: Option<(usize, String)> = None;
    let mut backoff = Duration::from_millis(50);
    loop {
        let outcome = register_once(
            rank,
            world_size,
            master_addr,
            master_port,
            token,
            rejoin,
            &mut listener,
            deadline,
            timeout,
        );
        let reason = match outcome {
            Ok(joined) => {
                return Ok((listener.expect("bound on success"), joined));
            }
            Err(Attempt::Failed(e)) => {
                return Err(match (e, &rejected) {
                    // Rejected before, and now out of time: the token is the cause.
                    (CollectiveError::Rendezvous(m), Some((n, why))) => {
                        token_rejected(rank, master_addr, master_port, *n, why, timeout, &m)
                    }
                    (e, _) => e,
                });
            }
            Err(Attempt::Rejected(reason)) => reason,
        };
        let n = rejected.as_ref().map_or(0, |(n, _)| *n) + 1;
        rejected = Some((n, reason.clone()));
        // Until the deadline: the rejection cannot be authenticated (this rank lacks the
        // token that would check it), and a rank with the right token loses nothing.
        thread::sleep(backoff.min(remaining(deadline)));
        if Instant::now() >= deadline {
            return Err(token_rejected(
                rank,
                master_addr,
                master_port,
                n,
                &reason,
                timeout,
                "",
            ));
        }
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

fn token_rejected(
    rank: usize,
    master_addr: &str,
    master_port: u16,
    times: usize,
    why: &str,
    timeout: Duration,
    last: &str,
) -> CollectiveError {
    let last = if last.is_empty() {
        String::new()
    } else {
        format!("; last attempt: {last}")
    };
    CollectiveError::JobToken {
        rank,
        reason: format!(
            "rank 0's rendezvous at {master_addr}:{master_port} rejected this rank's \
             registration {times} time(s) ({why}) until the rendezvous timeout of {timeout:?}{last}; \
             start every rank with the same {JOB_TOKEN_ENV} (burnrun gives its ranks one)"
        ),
    }
}

/// Why one registration attempt did not give the address table.
enum Attempt {
    /// The store rejected the registration's authentication (try again).
    Rejected(String),
    /// The rendezvous failed.
    Failed(CollectiveError),
}

impl From<CollectiveError> for Attempt {
    fn from(e: CollectiveError) -> Self {
        Attempt::Failed(e)
    }
}

/// One connection to the store: challenge, registration, reply.
#[allow(clippy::too_many_arguments)]
fn register_once(
    rank: usize,
    world_size: usize,
    master_addr: &str,
    master_port: u16,
    token: Option<&JobToken>,
    rejoin: bool,
    listener: &mut Option<TcpListener>,
    deadline: Instant,
    timeout: Duration,
) -> std::result::Result<Joined, Attempt> {
    let mut stream = connect_with_retry(
        master_addr,
        master_port,
        deadline,
        "the rendezvous of rank 0 (MASTER_ADDR:MASTER_PORT)",
    )
    .map_err(|e| match e {
        CollectiveError::Rendezvous(m) => CollectiveError::Rendezvous(format!(
            "rank {rank}: {m}; is rank 0 running, and do MASTER_ADDR/MASTER_PORT point at it?"
        )),
        other => other,
    })?;
    let io_err = |what: &str, e: io::Error| {
        CollectiveError::Rendezvous(format!(
            "rank {rank}: {what} the rendezvous at {master_addr}:{master_port}: {e}"
        ))
    };
    if listener.is_none() {
        let local_ip = stream
            .local_addr()
            .map_err(|e| io_err("cannot talk to", e))?
            .ip();
        *listener = Some(bind_data_listener(local_ip)?);
    }
    let data_addr = listener
        .as_ref()
        .expect("bound above")
        .local_addr()
        .map_err(|e| io_err("cannot set up the data listener for", e))?;

    stream
        .set_read_timeout(Some(bounded(deadline, MESSAGE_WAIT)))
        .and_then(|()| stream.set_write_timeout(Some(bounded(deadline, MESSAGE_WAIT))))
        .map_err(|e| io_err("cannot talk to", e))?;
    let challenge: Challenge =
        recv_message(&mut stream).map_err(|e| io_err("did not get a challenge from", e))?;
    match (challenge.authenticated, token) {
        (true, None) => {
            return Err(CollectiveError::JobToken {
                rank,
                reason: format!(
                    "rank 0 has a job token but this rank has none: start every rank with the \
                     same {JOB_TOKEN_ENV} (burnrun gives its ranks one), or none"
                ),
            }
            .into());
        }
        (false, Some(_)) => {
            return Err(CollectiveError::JobToken {
                rank,
                reason: format!(
                    "this rank has a job token but rank 0 has none: start every rank with the \
                     same {JOB_TOKEN_ENV}, or none"
                ),
            }
            .into());
        }
        _ => {}
    }
    let mut registration = Registration {
        rank,
        world_size,
        data_addr,
        pid: std::process::id(),
        nonce: random_bytes()?,
        tag: None,
        rejoin,
    };
    if let Some(token) = token {
        let mut buf = Vec::new();
        let tag = token.tag(
            REGISTER_LABEL,
            &registration.tag_parts(&challenge.nonce, &mut buf),
        );
        registration.tag = Some(tag);
    }
    send_message(&mut stream, &registration).map_err(|e| io_err("cannot register with", e))?;
    stream
        .set_read_timeout(Some(bounded(deadline, Duration::MAX)))
        .map_err(|e| io_err("cannot talk to", e))?;
    let not_authenticated = |what: &str| {
        Attempt::Failed(CollectiveError::JobToken {
            rank,
            reason: format!(
                "the {what} of the rendezvous at {master_addr}:{master_port} does not carry a \
                 valid HMAC of this job's token: is MASTER_ADDR:MASTER_PORT this job's rank 0?"
            ),
        })
    };
    match recv_message::<Reply>(&mut stream) {
        Ok(Reply::Accepted {
            session,
            addrs,
            tag,
        }) => {
            if let Some(token) = token {
                let signed = accepted_parts(session, &addrs);
                if !tag.is_some_and(|tag| {
                    token.verify(ACCEPTED_LABEL, &[&registration.nonce, &signed], &tag)
                }) {
                    return Err(not_authenticated("address table"));
                }
            }
            if addrs.len() != world_size {
                return Err(CollectiveError::Rendezvous(format!(
                    "rank {rank}: rank 0 sent {} addresses for a world of {world_size}",
                    addrs.len()
                ))
                .into());
            }
            Ok(Joined::Forming { session, addrs })
        }
        Ok(Reply::Running {
            session,
            addrs,
            states,
            tag,
        }) => {
            if let Some(token) = token {
                let signed = running_parts(session, &addrs, &states);
                if !tag.is_some_and(|tag| {
                    token.verify(RUNNING_LABEL, &[&registration.nonce, &signed], &tag)
                }) {
                    return Err(not_authenticated("address table"));
                }
            }
            if !rejoin {
                // Rank 0 answers so only registrations that asked to rejoin.
                return Err(CollectiveError::Rendezvous(format!(
                    "rank {rank}: rank 0 says the job is already running, but this rank was \
                     started without BURN_PARALLEL_FAULT_TOLERANT=1"
                ))
                .into());
            }
            if addrs.len() != world_size || states.len() != world_size {
                return Err(CollectiveError::Rendezvous(format!(
                    "rank {rank}: rank 0 sent {} addresses and {} states for a world of \
                     {world_size}",
                    addrs.len(),
                    states.len()
                ))
                .into());
            }
            Ok(Joined::Running {
                session,
                addrs,
                states,
            })
        }
        Ok(Reply::Refused { reason, tag }) => {
            if let Some(token) = token
                && !tag.is_some_and(|tag| {
                    token.verify(
                        REFUSED_LABEL,
                        &[&registration.nonce, reason.as_bytes()],
                        &tag,
                    )
                })
            {
                return Err(not_authenticated("refusal"));
            }
            Err(CollectiveError::Rendezvous(reason).into())
        }
        Ok(Reply::Rejected { reason }) => Err(Attempt::Rejected(reason)),
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            Err(CollectiveError::Rendezvous(format!(
                "rank {rank}: registered with rank 0 at {master_addr}:{master_port} but the \
                 world did not form within {timeout:?} (are all WORLD_SIZE={world_size} ranks \
                 started?)"
            ))
            .into())
        }
        Err(e) => Err(io_err("lost the connection to (did rank 0 fail?)", e).into()),
    }
}

/// The fields both ends of a data connection check: the session, the world size, the
/// dialer's rank and the accepting rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Link {
    session: u64,
    world_size: u32,
    from: u32,
    to: u32,
}

impl Link {
    const LEN: usize = 20;

    fn encode(&self, buf: &mut Vec<u8>) {
        buf.extend_from_slice(&self.session.to_le_bytes());
        buf.extend_from_slice(&self.world_size.to_le_bytes());
        buf.extend_from_slice(&self.from.to_le_bytes());
        buf.extend_from_slice(&self.to.to_le_bytes());
    }

    fn decode(b: &[u8]) -> Self {
        let u32_at = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
        Self {
            session: u64::from_le_bytes(b[..8].try_into().expect("8 bytes")),
            world_size: u32_at(8),
            from: u32_at(12),
            to: u32_at(16),
        }
    }
}

/// Challenge: magic, version, nonce.
const CHALLENGE_LEN: usize = 5 + NONCE_LEN;
/// Hello: magic, version, link, the dialer's nonce, tag.
const HELLO_LEN: usize = 5 + Link::LEN + NONCE_LEN + TAG_LEN;
/// Answer: magic, version, link (from the accepting rank), tag.
const ANSWER_LEN: usize = 5 + Link::LEN + TAG_LEN;

fn start_message(magic: &[u8; 4]) -> Vec<u8> {
    let mut buf = Vec::with_capacity(HELLO_LEN);
    buf.extend_from_slice(magic);
    buf.push(PROTOCOL);
    buf
}

fn check_start(buf: &[u8], magic: &[u8; 4], what: &str) -> io::Result<()> {
    if &buf[..4] != magic {
        return Err(invalid(format!("not a burn-parallel {what}")));
    }
    if buf[4] != PROTOCOL {
        return Err(invalid(format!(
            "{what} of protocol version {} (this build speaks {PROTOCOL}): mixed builds?",
            buf[4]
        )));
    }
    Ok(())
}

/// The tag of a hello or answer (zeros without a job token).
fn link_tag(
    token: Option<&JobToken>,
    label: &str,
    nonce: &Nonce,
    link: &[u8],
    extra: &[u8],
) -> Tag {
    token.map_or([0; TAG_LEN], |t| t.tag(label, &[nonce, link, extra]))
}

fn link_tag_ok(
    token: Option<&JobToken>,
    label: &str,
    nonce: &Nonce,
    link: &[u8],
    extra: &[u8],
    tag: &[u8],
) -> bool {
    token.is_none_or(|t| t.verify(label, &[nonce, link, extra], tag))
}

/// The dialer's side of a data connection to `peer`: reads the challenge, sends the hello,
/// checks the answer.
fn dial(
    link: Link,
    addr: SocketAddr,
    token: Option<&JobToken>,
    deadline: Instant,
) -> std::result::Result<TcpStream, String> {
    let peer = link.to;
    let mut stream = connect_with_retry(
        &addr.ip().to_string(),
        addr.port(),
        deadline,
        &format!("the data listener of rank {peer}"),
    )
    .map_err(|e| e.to_string())?;
    let fail = |what: &str, e: io::Error| format!("{what} rank {peer} at {addr} failed: {e}");
    stream
        .set_read_timeout(Some(bounded(deadline, MESSAGE_WAIT)))
        .and_then(|()| stream.set_write_timeout(Some(bounded(deadline, MESSAGE_WAIT))))
        .map_err(|e| fail("setting up the connection to", e))?;
    let mut challenge = [0u8; CHALLENGE_LEN];
    stream
        .read_exact(&mut challenge)
        .and_then(|()| check_start(&challenge, CHALLENGE_MAGIC, "data-connection challenge"))
        .map_err(|e| fail("reading the challenge of", e))?;
    let their_nonce: Nonce = challenge[5..].try_into().expect("nonce bytes");
    let our_nonce: Nonce = random_bytes().map_err(|e| e.to_string())?;
    let mut link_bytes = Vec::with_capacity(Link::LEN);
    link.encode(&mut link_bytes);
    let mut hello = start_message(HELLO_MAGIC);
    hello.extend_from_slice(&link_bytes);
    hello.extend_from_slice(&our_nonce);
    hello.extend_from_slice(&link_tag(
        token,
        HELLO_LABEL,
        &their_nonce,
        &link_bytes,
        &our_nonce,
    ));
    stream
        .write_all(&hello)
        .map_err(|e| fail("the handshake with", e))?;
    let mut answer = [0u8; ANSWER_LEN];
    stream
        .read_exact(&mut answer)
        .and_then(|()| check_start(&answer, ANSWER_MAGIC, "data-connection answer"))
        .map_err(|e| fail("reading the answer of", e))?;
    let body = &answer[5..5 + Link::LEN];
    let expected = Link {
        from: link.to,
        to: link.from,
        ..link
    };
    if Link::decode(body) != expected {
        return Err(format!(
            "the data listener of rank {peer} at {addr} answered for {:?}, expected {expected:?}",
            Link::decode(body)
        ));
    }
    if !link_tag_ok(
        token,
        ANSWER_LABEL,
        &our_nonce,
        body,
        &[],
        &answer[5 + Link::LEN..],
    ) {
        return Err(format!(
            "the data listener of rank {peer} at {addr} does not prove this job's token (its \
             HMAC does not match)"
        ));
    }
    Ok(stream)
}

/// Checks a dialer's hello against the challenge `nonce` sent to it: its job-token HMAC, the
/// session, the world size and that it is meant for `rank`. Returns the rank it claims, its
/// link and its own challenge.
fn verify_hello(
    hello: &[u8],
    nonce: &Nonce,
    token: Option<&JobToken>,
    session: u64,
    world_size: usize,
    rank: usize,
) -> std::result::Result<(usize, Link, Nonce), String> {
    check_start(hello, HELLO_MAGIC, "handshake").map_err(|e| e.to_string())?;
    let body = &hello[5..5 + Link::LEN];
    let their_nonce = &hello[5 + Link::LEN..5 + Link::LEN + NONCE_LEN];
    let tag = &hello[5 + Link::LEN + NONCE_LEN..];
    let link = Link::decode(body);
    if !link_tag_ok(token, HELLO_LABEL, nonce, body, their_nonce, tag) {
        return Err("wrong job token (the HMAC of the challenge does not match)".into());
    }
    if link.session != session {
        return Err("handshake from another job (session differs)".into());
    }
    if link.world_size as usize != world_size || link.to as usize != rank {
        return Err(format!("handshake for another world or rank: {link:?}"));
    }
    if link.from as usize >= world_size || link.from as usize == rank {
        return Err(format!("claimed rank {}, unexpected", link.from));
    }
    Ok((
        link.from as usize,
        link,
        their_nonce.try_into().expect("nonce bytes"),
    ))
}

/// Answers a verified hello: this rank's side of the link, with the HMAC of the dialer's
/// challenge. Leaves the stream blocking.
fn answer_hello(
    stream: &mut TcpStream,
    rank: usize,
    link: Link,
    their_nonce: &Nonce,
    token: Option<&JobToken>,
    write_timeout: Duration,
) -> io::Result<()> {
    let reply = Link {
        from: rank as u32,
        to: link.from,
        ..link
    };
    let mut reply_bytes = Vec::with_capacity(Link::LEN);
    reply.encode(&mut reply_bytes);
    let mut answer = start_message(ANSWER_MAGIC);
    answer.extend_from_slice(&reply_bytes);
    answer.extend_from_slice(&link_tag(
        token,
        ANSWER_LABEL,
        their_nonce,
        &reply_bytes,
        &[],
    ));
    stream.set_nonblocking(false)?;
    stream.set_write_timeout(Some(write_timeout))?;
    stream.write_all(&answer)
}

/// The accepting side of step 3: accepts the connections of the ranks below `rank` until
/// each has proven itself, `deadline` passes, or `stop` is set.
fn accept_lower(
    rank: usize,
    world_size: usize,
    session: u64,
    listener: &TcpListener,
    token: Option<&JobToken>,
    deadline: Instant,
    stop: &AtomicBool,
) -> std::result::Result<Vec<Option<TcpStream>>, String> {
    let mut lower: Vec<Option<TcpStream>> = (0..rank).map(|_| None).collect();
    let mut waiting = rank;
    let mut pending: Vec<Pending> = Vec::new();
    let mut dropped = Dropped::new(rank, "the data listener");
    let challenge = |nonce: &Nonce| {
        let mut buf = start_message(CHALLENGE_MAGIC);
        buf.extend_from_slice(nonce);
        Ok(buf)
    };
    while waiting > 0 {
        if stop.load(Ordering::Relaxed) {
            return Err("stopped".into());
        }
        if Instant::now() >= deadline {
            let missing: Vec<usize> = (0..rank).filter(|&p| lower[p].is_none()).collect();
            return Err(format!(
                "rank(s) {missing:?} did not connect before the rendezvous timeout{}",
                dropped.summary()
            ));
        }
        let mut progressed = accept_pending(listener, &mut pending, &mut dropped, challenge)
            .map_err(|e| format!("accepting a data connection failed: {e}"))?;
        let ready = ready_messages(&mut pending, |_| Ok(HELLO_LEN), "hello", &mut dropped);
        progressed |= !ready.is_empty();
        for (p, hello) in ready {
            let Pending {
                mut stream,
                from,
                nonce,
                ..
            } = p;
            let (peer, link, their_nonce) =
                match verify_hello(&hello, &nonce, token, session, world_size, rank) {
                    Ok(checked) => checked,
                    Err(why) => {
                        dropped.record(from, why);
                        continue;
                    }
                };
            if peer >= rank || lower[peer].is_some() {
                dropped.record(from, format!("claimed rank {peer}, unexpected"));
                continue;
            }
            answer_hello(
                &mut stream,
                rank,
                link,
                &their_nonce,
                token,
                bounded(deadline, MESSAGE_WAIT),
            )
            .map_err(|e| format!("handshake with rank {peer} failed: {e}"))?;
            lower[peer] = Some(stream);
            waiting -= 1;
        }
        if !progressed {
            wait_readable(listener, &pending, remaining(deadline));
        }
    }
    Ok(lower)
}

/// Step 3: connects this rank to every other rank. Lower ranks dial higher ones; each rank
/// accepts (on another thread) while it dials, so no rank waits on another's progress.
pub(crate) fn form_mesh(
    rank: usize,
    world_size: usize,
    session: u64,
    listener: &TcpListener,
    addrs: &[SocketAddr],
    token: Option<&JobToken>,
    deadline: Instant,
) -> Result<Mesh> {
    let fail = |what: String| CollectiveError::Rendezvous(format!("rank {rank}: {what}"));
    listener
        .set_nonblocking(true)
        .map_err(|e| fail(format!("data listener: {e}")))?;
    let stop = AtomicBool::new(false);
    let (lower, higher) = thread::scope(|scope| {
        let acceptor = thread::Builder::new()
            .name(format!("burn-tcp-accept-{rank}"))
            .spawn_scoped(scope, || {
                accept_lower(rank, world_size, session, listener, token, deadline, &stop)
            })
            .map_err(|e| fail(format!("cannot start the accepting thread: {e}")))?;
        let mut higher = Vec::new();
        for (peer, addr) in addrs.iter().enumerate().skip(rank + 1) {
            let link = Link {
                session,
                world_size: world_size as u32,
                from: rank as u32,
                to: peer as u32,
            };
            match dial(link, *addr, token, deadline) {
                Ok(stream) => higher.push(stream),
                Err(e) => {
                    stop.store(true, Ordering::Relaxed);
                    let _ = acceptor.join();
                    return Err(fail(e));
                }
            }
        }
        let lower = acceptor
            .join()
            .map_err(|_| fail("the accepting thread panicked".into()))?
            .map_err(fail)?;
        Ok((lower, higher))
    })?;
    let mut mesh: Mesh = lower;
    mesh.push(None);
    mesh.extend(higher.into_iter().map(Some));
    debug_assert_eq!(mesh.len(), world_size);
    Ok(mesh)
}

/// Dials `link.to` at `addr` like step 3, retrying until `deadline` when the handshake fails:
/// the peer may not have noticed yet that the previous process of this rank is gone, and
/// refuses a rank it still sees healthy.
pub(crate) fn dial_until(
    link: Link,
    addr: SocketAddr,
    token: Option<&JobToken>,
    deadline: Instant,
    stop: &AtomicBool,
) -> std::result::Result<TcpStream, String> {
    let mut backoff = Duration::from_millis(20);
    loop {
        let error = match dial(link, addr, token, deadline) {
            Ok(stream) => return Ok(stream),
            Err(e) => e,
        };
        if remaining(deadline).is_zero() || stop.load(Ordering::Relaxed) {
            return Err(error);
        }
        thread::sleep(backoff.min(remaining(deadline)));
        backoff = (backoff * 2).min(Duration::from_millis(500));
    }
}

/// The link a rank dials to `to`.
pub(crate) fn link(session: u64, world_size: usize, from: usize, to: usize) -> Link {
    Link {
        session,
        world_size: world_size as u32,
        from: from as u32,
        to: to as u32,
    }
}

/// What a rank's data listener keeps doing once the world runs with rejoining on.
pub(crate) struct RejoinListener<'a> {
    pub rank: usize,
    pub world_size: usize,
    pub session: u64,
    pub listener: &'a TcpListener,
    pub token: Option<&'a JobToken>,
    /// Ends the loop.
    pub stop: &'a AtomicBool,
}

/// Answers a verified hello (the last step of the handshake), given to [`Take`].
pub(crate) type Answer<'a> = &'a mut dyn FnMut(&mut TcpStream) -> io::Result<()>;

/// Takes the connection of a restarted rank: `Ok` once it replaced the rank's connection
/// (after calling the answer), `Err(why)` when it refuses it (the rank is healthy).
pub(crate) type Take<'a> =
    &'a mut dyn FnMut(usize, TcpStream, Answer<'_>) -> std::result::Result<(), String>;

/// Accepts the data connections of restarted ranks until `stop` is set: an authenticated
/// hello is handed to `take`, which answers it once the rank's failed connection (or its
/// missing one) is out of the way, or refuses it (the rank is healthy); a refused or
/// unauthenticated connection is dropped with a line on stderr, and the job goes on.
pub(crate) fn serve_rejoin_dials(serving: RejoinListener<'_>, take: Take<'_>) {
    let RejoinListener {
        rank,
        world_size,
        session,
        listener,
        token,
        stop,
    } = serving;
    if let Err(e) = listener.set_nonblocking(true) {
        eprintln!(
            "burn-parallel rank {rank}: the data listener stops, restarted ranks cannot \
             reconnect to this rank: {e}"
        );
        return;
    }
    let mut pending: Vec<Pending> = Vec::new();
    let mut dropped = Dropped::new(rank, "the data listener");
    let challenge = |nonce: &Nonce| {
        let mut buf = start_message(CHALLENGE_MAGIC);
        buf.extend_from_slice(nonce);
        Ok(buf)
    };
    while !stop.load(Ordering::Relaxed) {
        let mut progressed = match accept_pending(listener, &mut pending, &mut dropped, challenge) {
            Ok(any) => any,
            Err(e) => {
                eprintln!(
                    "burn-parallel rank {rank}: accepting a data connection failed, restarted \
                     ranks cannot reconnect to this rank: {e}"
                );
                return;
            }
        };
        let ready = ready_messages(&mut pending, |_| Ok(HELLO_LEN), "hello", &mut dropped);
        progressed |= !ready.is_empty();
        for (p, hello) in ready {
            let Pending {
                stream,
                from,
                nonce,
                ..
            } = p;
            let (peer, link, their_nonce) =
                match verify_hello(&hello, &nonce, token, session, world_size, rank) {
                    Ok(checked) => checked,
                    Err(why) => {
                        dropped.record(from, why);
                        continue;
                    }
                };
            let mut answer = |stream: &mut TcpStream| {
                answer_hello(stream, rank, link, &their_nonce, token, MESSAGE_WAIT)
            };
            if let Err(why) = take(peer, stream, &mut answer) {
                dropped.record(from, why);
            }
        }
        if !progressed {
            wait_readable(listener, &pending, POLL_CAP);
        }
    }
}

/// The address to report for rank 0's own data listener (nobody dials rank 0, which dials
/// everyone; the address is informative).
pub(crate) fn rank0_data_addr(store: &TcpListener, data: &TcpListener) -> SocketAddr {
    let ip = store
        .local_addr()
        .map(|a| a.ip())
        .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
    let port = data.local_addr().map(|a| a.port()).unwrap_or(0);
    SocketAddr::new(ip, port)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_running_store_refuses_rank_0_and_healthy_ranks() {
        let store = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = store.local_addr().unwrap().port();
        let token = JobToken::new("a secret for the running store test").unwrap();
        let stop = AtomicBool::new(false);
        let addr: SocketAddr = "127.0.0.1:1".parse().unwrap();
        thread::scope(|scope| {
            scope.spawn(|| {
                serve_running_store(
                    RunningStore {
                        store: &store,
                        world_size: 3,
                        token: Some(&token),
                        session: 7,
                        addrs: vec![addr; 3],
                        join_window: Duration::from_secs(5),
                        stop: &stop,
                    },
                    &|r| r == 1,
                )
            });
            let register_as = |rank: usize| {
                let deadline = Instant::now() + Duration::from_secs(5);
                let timeout = Duration::from_secs(5);
                register(
                    rank,
                    3,
                    "127.0.0.1",
                    port,
                    Some(&token),
                    true,
                    deadline,
                    timeout,
                )
            };
            for (rank, expected) in [
                (0, "rank 0 cannot be replaced"),
                (1, "rank 1 is still running in this job"),
            ] {
                match register_as(rank) {
                    Err(CollectiveError::Rendezvous(m)) => assert!(m.contains(expected), "{m}"),
                    Err(e) => panic!("rank {rank}: {e}"),
                    Ok(_) => panic!("rank {rank} was let in"),
                }
            }
            match register_as(2) {
                Ok((
                    _,
                    Joined::Running {
                        session,
                        addrs,
                        states,
                    },
                )) => {
                    assert_eq!(session, 7);
                    assert_ne!(addrs[2], addr, "the table has the new address");
                    assert_eq!(states, vec![RankState::Up, RankState::Up, RankState::Down]);
                }
                Err(e) => panic!("rank 2: {e}"),
                Ok(_) => panic!("rank 2 was not told the world runs"),
            }
            stop.store(true, Ordering::Relaxed);
        });
    }

    /// A hello claiming to be rank 0 of `session`, for `their_nonce`, tagged with `token`.
    fn hello_bytes(session: u64, token: &JobToken, their_nonce: &Nonce) -> Vec<u8> {
        let link = Link {
            session,
            world_size: 2,
            from: 0,
            to: 1,
        };
        let mut link_bytes = Vec::new();
        link.encode(&mut link_bytes);
        let our_nonce = [3u8; NONCE_LEN];
        let mut hello = start_message(HELLO_MAGIC);
        hello.extend_from_slice(&link_bytes);
        hello.extend_from_slice(&our_nonce);
        hello.extend_from_slice(&link_tag(
            Some(token),
            HELLO_LABEL,
            their_nonce,
            &link_bytes,
            &our_nonce,
        ));
        hello
    }

    /// Connects to `addr` and reads the data listener's challenge.
    fn challenged(addr: SocketAddr) -> (TcpStream, Nonce) {
        let mut stream = TcpStream::connect(addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut challenge = [0u8; CHALLENGE_LEN];
        stream.read_exact(&mut challenge).unwrap();
        assert_eq!(&challenge[..4], CHALLENGE_MAGIC);
        (stream, challenge[5..].try_into().unwrap())
    }

    #[test]
    fn forged_and_replayed_hellos_do_not_take_a_ranks_place() {
        let token = JobToken::new("right").unwrap();
        let wrong = JobToken::new("wrong").unwrap();
        let session = 0x5eed;
        let localhost = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let listeners = [
            bind_data_listener(localhost).unwrap(),
            bind_data_listener(localhost).unwrap(),
        ];
        let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
        let deadline = Instant::now() + Duration::from_secs(10);
        let [l0, l1] = listeners;
        let (mesh0, mesh1, forged) = thread::scope(|scope| {
            let rank1 =
                scope.spawn(|| form_mesh(1, 2, session, &l1, &addrs, Some(&token), deadline));
            // A stray connection, garbage, a hello of the wrong token, and a hello of the right
            // token replayed from another connection's challenge: rank 1 must drop them all.
            let _silent = TcpStream::connect(addrs[1]).unwrap();
            let (mut garbage, _) = challenged(addrs[1]);
            garbage.write_all(&[0xAB; HELLO_LEN]).unwrap();
            let (mut forged, nonce) = challenged(addrs[1]);
            forged
                .write_all(&hello_bytes(session, &wrong, &nonce))
                .unwrap();
            let (_, old_nonce) = challenged(addrs[1]);
            let (mut replayed, _) = challenged(addrs[1]);
            replayed
                .write_all(&hello_bytes(session, &token, &old_nonce))
                .unwrap();
            // Then the real rank 0.
            let mesh0 = form_mesh(0, 2, session, &l0, &addrs, Some(&token), deadline).unwrap();
            let mesh1 = rank1.join().unwrap().unwrap();
            let answers: Vec<usize> = [forged, replayed, garbage]
                .into_iter()
                .map(|mut s| {
                    let mut rest = Vec::new();
                    let _ = s.read_to_end(&mut rest);
                    rest.len()
                })
                .collect();
            (mesh0, mesh1, answers)
        });
        // The forgers got no answer; rank 0 and rank 1 are connected to each other.
        assert_eq!(forged, vec![0, 0, 0]);
        let mut a = mesh0[1].as_ref().unwrap();
        let mut b = mesh1[0].as_ref().unwrap();
        a.write_all(b"ping").unwrap();
        let mut got = [0u8; 4];
        b.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"ping");
    }
}
