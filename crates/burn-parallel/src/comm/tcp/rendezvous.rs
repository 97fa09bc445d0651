//! Forming a `tcp` world: the rendezvous store served by rank 0, then the full mesh.
//!
//! 1. Every rank binds a data listener on port 0 and registers `(rank, world size, data
//!    address)` with rank 0's store at `MASTER_ADDR:MASTER_PORT`, retrying with backoff until
//!    the store answers (rank 0 may start last).
//! 2. Rank 0 validates each registration: a different world size, a rank out of range or a rank
//!    claimed twice is refused, with a message sent to the offender and to every rank already
//!    registered, and rank 0 fails too. Once every rank has registered, rank 0 sends the
//!    address table and a random session number to all.
//! 3. Every rank dials the data listeners of the higher ranks and accepts the lower ones; a
//!    handshake carrying the session number, the world size and the dialer's rank identifies
//!    each connection (a stray connection from another job is dropped).
//!
//! Every step is bounded by the one deadline of [`super::TcpConfig::timeout`].

use std::hash::{BuildHasher, Hasher, RandomState};
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::thread;
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::{CollectiveError, Result};

/// Tags the messages of the rendezvous store.
const STORE_MAGIC: &[u8; 4] = b"BPRV";
/// Tags the handshake of a data connection.
const HELLO_MAGIC: &[u8; 4] = b"BPHS";
/// Version of the rendezvous protocol.
const PROTOCOL: u8 = 1;
/// Largest store message accepted.
const MAX_STORE_MESSAGE: u32 = 16 << 20;
/// Longest wait for one message of a process that has connected.
const MESSAGE_WAIT: Duration = Duration::from_secs(5);

/// What a rank tells rank 0.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Registration {
    rank: usize,
    world_size: usize,
    data_addr: SocketAddr,
    pid: u32,
}

/// Rank 0's answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum Reply {
    /// The world is formed: the data address of every rank and the session number.
    Accepted {
        session: u64,
        addrs: Vec<SocketAddr>,
    },
    /// The world cannot be formed.
    Refused { reason: String },
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

fn send_message(stream: &mut TcpStream, value: &impl Serialize) -> io::Result<()> {
    let body = serde_json::to_vec(value).map_err(io::Error::other)?;
    let mut buf = Vec::with_capacity(9 + body.len());
    buf.extend_from_slice(STORE_MAGIC);
    buf.push(PROTOCOL);
    buf.extend_from_slice(&(body.len() as u32).to_le_bytes());
    buf.extend_from_slice(&body);
    stream.write_all(&buf)?;
    stream.flush()
}

fn recv_message<T: DeserializeOwned>(stream: &mut TcpStream) -> io::Result<T> {
    let mut head = [0u8; 9];
    stream.read_exact(&mut head)?;
    let invalid = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
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
    let mut body = vec![0u8; len as usize];
    stream.read_exact(&mut body)?;
    serde_json::from_slice(&body).map_err(|e| invalid(format!("garbled rendezvous message: {e}")))
}

/// A random number identifying one world, so that connections from another job are refused.
fn new_session() -> u64 {
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    hasher.write_u32(std::process::id());
    hasher.finish()
}

/// Binds a listener on port 0 of `ip` (the interface that reaches rank 0).
pub(crate) fn bind_data_listener(ip: IpAddr) -> Result<TcpListener> {
    TcpListener::bind(SocketAddr::new(ip, 0)).map_err(|e| {
        CollectiveError::Rendezvous(format!("cannot open a data listener on {ip}: {e}"))
    })
}

/// The unspecified address of `ip`'s family.
pub(crate) fn unspecified_like(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    }
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
        if Instant::now() + backoff >= deadline {
            return Err(CollectiveError::Rendezvous(format!(
                "could not connect to {what} at {host}:{port} before the rendezvous timeout \
                 (last error: {last_error})"
            )));
        }
        thread::sleep(backoff);
        backoff = (backoff * 2).min(Duration::from_millis(500));
    }
}

/// Rank 0's side of step 2: serves the store on `store` until every rank has registered.
/// Returns the session number and the address table.
pub(crate) fn serve_store(
    store: &TcpListener,
    world_size: usize,
    own_data_addr: SocketAddr,
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
    let mut registered: Vec<Option<(TcpStream, Registration, SocketAddr)>> =
        (0..world_size).map(|_| None).collect();
    let mut missing = world_size - 1;
    let mut ignored: Vec<String> = Vec::new();

    // Refuses the world: tells every registered rank (and the offender) why, then fails.
    let refuse = |registered: &mut Vec<Option<(TcpStream, Registration, SocketAddr)>>,
                  offender: Option<&mut TcpStream>,
                  reason: String| {
        let reason = format!("rank 0 could not form the world: {reason}");
        let reply = Reply::Refused {
            reason: reason.clone(),
        };
        if let Some(stream) = offender {
            let _ = send_message(stream, &reply);
        }
        for (stream, _, _) in registered.iter_mut().flatten() {
            let _ = send_message(stream, &reply);
        }
        CollectiveError::Rendezvous(reason)
    };

    while missing > 0 {
        if Instant::now() >= deadline {
            let waiting: Vec<usize> = (1..world_size)
                .filter(|&r| registered[r].is_none())
                .collect();
            let mut reason = format!(
                "timed out after {timeout:?} waiting for rank(s) {waiting:?} of a world of \
                 {world_size} to register at {store_addr} (are they started, with MASTER_ADDR \
                 and MASTER_PORT pointing at rank 0, and the same WORLD_SIZE?)"
            );
            if !ignored.is_empty() {
                reason.push_str(&format!("; ignored connections: {}", ignored.join("; ")));
            }
            return Err(refuse(&mut registered, None, reason));
        }
        let (mut stream, from) = match store.accept() {
            Ok(accepted) => accepted,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                thread::sleep(Duration::from_millis(2));
                continue;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(refuse(
                    &mut registered,
                    None,
                    format!("accepting on {store_addr} failed: {e}"),
                ));
            }
        };
        let setup = stream
            .set_nonblocking(false)
            .and_then(|()| stream.set_read_timeout(Some(bounded(deadline, MESSAGE_WAIT))))
            .and_then(|()| stream.set_write_timeout(Some(MESSAGE_WAIT)));
        let registration = match setup.and_then(|()| recv_message::<Registration>(&mut stream)) {
            Ok(r) => r,
            Err(e) => {
                ignored.push(format!("{from}: {e}"));
                continue;
            }
        };
        let r = registration.rank;
        if registration.world_size != world_size {
            return Err(refuse(
                &mut registered,
                Some(&mut stream),
                format!(
                    "rank {r} (at {from}, pid {}) was started with WORLD_SIZE={} but rank 0 with \
                     WORLD_SIZE={world_size}; start every rank with the same WORLD_SIZE",
                    registration.pid, registration.world_size
                ),
            ));
        }
        if r >= world_size {
            return Err(refuse(
                &mut registered,
                Some(&mut stream),
                format!(
                    "rank {r} (at {from}, pid {}) is out of range for WORLD_SIZE={world_size}; \
                     RANK must be in 0..{world_size}",
                    registration.pid
                ),
            ));
        }
        if r == 0 {
            return Err(refuse(
                &mut registered,
                Some(&mut stream),
                format!(
                    "a second process (at {from}, pid {}) claims rank 0, but rank 0 is the \
                     process serving the rendezvous at {store_addr} (pid {}); every process \
                     needs a distinct RANK",
                    registration.pid,
                    std::process::id()
                ),
            ));
        }
        if let Some((_, first, first_from)) = &registered[r] {
            let reason = format!(
                "rank {r} is claimed by two processes (at {first_from}, pid {}, and at {from}, \
                 pid {}); every process needs a distinct RANK in 0..{world_size}",
                first.pid, registration.pid
            );
            return Err(refuse(&mut registered, Some(&mut stream), reason));
        }
        registered[r] = Some((stream, registration, from));
        missing -= 1;
    }

    let session = new_session();
    let mut addrs = vec![own_data_addr];
    addrs.extend(
        registered
            .iter()
            .skip(1)
            .map(|entry| entry.as_ref().expect("every rank registered").1.data_addr),
    );
    let reply = Reply::Accepted {
        session,
        addrs: addrs.clone(),
    };
    for (rank, entry) in registered.iter_mut().enumerate().skip(1) {
        let (stream, _, from) = entry.as_mut().expect("every rank registered");
        send_message(stream, &reply).map_err(|e| {
            CollectiveError::Rendezvous(format!(
                "rank {rank} (at {from}) registered but could not be sent the address table: {e}"
            ))
        })?;
    }
    Ok((session, addrs))
}

/// The store client of a rank other than 0: connects to rank 0 (retrying until `deadline`),
/// binds this rank's data listener on the interface that reaches rank 0, registers, and waits
/// for the address table.
pub(crate) fn register(
    rank: usize,
    world_size: usize,
    master_addr: &str,
    master_port: u16,
    deadline: Instant,
    timeout: Duration,
) -> Result<(TcpListener, u64, Vec<SocketAddr>)> {
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
    let local_ip = stream
        .local_addr()
        .map_err(|e| io_err("cannot talk to", e))?
        .ip();
    let listener = bind_data_listener(local_ip)?;
    let data_addr = listener
        .local_addr()
        .map_err(|e| io_err("cannot set up the data listener for", e))?;
    stream
        .set_write_timeout(Some(bounded(deadline, MESSAGE_WAIT)))
        .map_err(|e| io_err("cannot talk to", e))?;
    send_message(
        &mut stream,
        &Registration {
            rank,
            world_size,
            data_addr,
            pid: std::process::id(),
        },
    )
    .map_err(|e| io_err("cannot register with", e))?;
    stream
        .set_read_timeout(Some(bounded(deadline, Duration::MAX)))
        .map_err(|e| io_err("cannot talk to", e))?;
    match recv_message::<Reply>(&mut stream) {
        Ok(Reply::Accepted { session, addrs }) if addrs.len() == world_size => {
            Ok((listener, session, addrs))
        }
        Ok(Reply::Accepted { addrs, .. }) => Err(CollectiveError::Rendezvous(format!(
            "rank {rank}: rank 0 sent {} addresses for a world of {world_size}",
            addrs.len()
        ))),
        Ok(Reply::Refused { reason }) => Err(CollectiveError::Rendezvous(reason)),
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
            )))
        }
        Err(e) => Err(io_err("lost the connection to (did rank 0 fail?)", e)),
    }
}

/// The handshake that opens a data connection (both directions use the same format).
fn hello(session: u64, world_size: usize, rank: usize) -> [u8; 21] {
    let mut buf = [0u8; 21];
    buf[..4].copy_from_slice(HELLO_MAGIC);
    buf[4] = PROTOCOL;
    buf[5..13].copy_from_slice(&session.to_le_bytes());
    buf[13..17].copy_from_slice(&(world_size as u32).to_le_bytes());
    buf[17..21].copy_from_slice(&(rank as u32).to_le_bytes());
    buf
}

/// Reads a handshake; returns the sender's rank when it belongs to this world.
fn read_hello(stream: &mut TcpStream, session: u64, world_size: usize) -> io::Result<usize> {
    let mut buf = [0u8; 21];
    stream.read_exact(&mut buf)?;
    let invalid = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_string());
    if &buf[..4] != HELLO_MAGIC || buf[4] != PROTOCOL {
        return Err(invalid("not a burn-parallel handshake"));
    }
    if u64::from_le_bytes(buf[5..13].try_into().expect("8 bytes")) != session {
        return Err(invalid("handshake from another job (session differs)"));
    }
    if u32::from_le_bytes(buf[13..17].try_into().expect("4 bytes")) as usize != world_size {
        return Err(invalid("handshake with another world size"));
    }
    Ok(u32::from_le_bytes(buf[17..21].try_into().expect("4 bytes")) as usize)
}

/// Step 3: connects this rank to every other rank. Lower ranks dial higher ones; dials
/// complete in the listener's backlog, so no rank waits on another's progress.
pub(crate) fn form_mesh(
    rank: usize,
    world_size: usize,
    session: u64,
    listener: TcpListener,
    addrs: &[SocketAddr],
    deadline: Instant,
) -> Result<Mesh> {
    let fail = |what: String| CollectiveError::Rendezvous(format!("rank {rank}: {what}"));
    let mut mesh: Mesh = (0..world_size).map(|_| None).collect();

    // Dial every higher rank and introduce ourselves.
    for (peer, addr) in addrs.iter().enumerate().skip(rank + 1) {
        let mut stream = connect_with_retry(
            &addr.ip().to_string(),
            addr.port(),
            deadline,
            &format!("the data listener of rank {peer}"),
        )?;
        stream
            .set_write_timeout(Some(bounded(deadline, MESSAGE_WAIT)))
            .and_then(|()| stream.write_all(&hello(session, world_size, rank)))
            .map_err(|e| fail(format!("handshake with rank {peer} at {addr} failed: {e}")))?;
        mesh[peer] = Some(stream);
    }

    // Accept every lower rank.
    listener
        .set_nonblocking(true)
        .map_err(|e| fail(format!("data listener: {e}")))?;
    let mut waiting = rank;
    let mut ignored: Vec<String> = Vec::new();
    while waiting > 0 {
        if Instant::now() >= deadline {
            let missing: Vec<usize> = (0..rank).filter(|&p| mesh[p].is_none()).collect();
            let mut what =
                format!("rank(s) {missing:?} did not connect before the rendezvous timeout");
            if !ignored.is_empty() {
                what.push_str(&format!("; ignored connections: {}", ignored.join("; ")));
            }
            return Err(fail(what));
        }
        let (mut stream, from) = match listener.accept() {
            Ok(accepted) => accepted,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                thread::sleep(Duration::from_millis(1));
                continue;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(fail(format!("accepting a data connection failed: {e}"))),
        };
        let peer = stream
            .set_nonblocking(false)
            .and_then(|()| stream.set_read_timeout(Some(bounded(deadline, MESSAGE_WAIT))))
            .and_then(|()| read_hello(&mut stream, session, world_size));
        match peer {
            Ok(peer) if peer < rank && mesh[peer].is_none() => {
                stream
                    .set_write_timeout(Some(bounded(deadline, MESSAGE_WAIT)))
                    .and_then(|()| stream.write_all(&hello(session, world_size, rank)))
                    .map_err(|e| fail(format!("handshake with rank {peer} failed: {e}")))?;
                mesh[peer] = Some(stream);
                waiting -= 1;
            }
            Ok(peer) => ignored.push(format!("{from} claimed rank {peer}, unexpected")),
            Err(e) => ignored.push(format!("{from}: {e}")),
        }
    }
    drop(listener);

    // Read the answers of the higher ranks.
    for (peer, slot) in mesh.iter_mut().enumerate().skip(rank + 1) {
        let stream = slot.as_mut().expect("dialed above");
        let answer = stream
            .set_read_timeout(Some(bounded(deadline, Duration::MAX)))
            .and_then(|()| read_hello(stream, session, world_size));
        match answer {
            Ok(p) if p == peer => {}
            Ok(p) => {
                return Err(fail(format!(
                    "the data listener of rank {peer} answered as rank {p}"
                )));
            }
            Err(e) => {
                return Err(fail(format!(
                    "rank {peer} did not complete the handshake: {e}"
                )));
            }
        }
    }
    Ok(mesh)
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
