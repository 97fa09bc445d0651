//! The `tcp` backend: every rank is a process, ranks talk over TCP.
//!
//! Forming the world ([`connect_tcp`](crate::world::connect_tcp), [`init_from_env`](crate::world::init_from_env)): rank 0 serves a small rendezvous store on
//! `MASTER_ADDR:MASTER_PORT`; every rank registers its data address there, rank 0 checks that
//! the ranks agree (world size, distinct ranks) and sends everyone the address table, then the
//! ranks connect into a full mesh, one TCP connection per pair of ranks. The whole rendezvous
//! is bounded by [`TcpConfig::timeout`]: it ends with an error, never a hang.
//!
//! Moving data: a reader thread per peer parses incoming frames and delivers them to the
//! [`Mailbox`], so a rank always drains its sockets and a ring step can send to the next rank
//! while the previous one sends to it. A send writes the frame's header and payload with one
//! vectored write straight from the payload buffer; the reader allocates each payload once,
//! sized from the header. The frame format (versioned, with a magic number) is described in the
//! `wire` module.
//!
//! Failures: dropping the transport (the last clone of the [`ProcessGroup`](crate::ProcessGroup)) says goodbye to
//! every peer, which then treats this rank as finished. A connection that ends without a
//! goodbye (the process crashed or exited without dropping its group), a malformed frame, or
//! an explicit [`Transport::abort`] marks the rank as failed on every peer, whose pending and
//! future collective calls then fail with an error naming it.
//!
//! Rejoining (fault tolerance, [`TcpConfig::rejoin`], `BURN_PARALLEL_FAULT_TOLERANT=1`): once
//! the world is formed, rank 0 keeps serving the rendezvous store on a background thread and
//! every rank keeps its data listener, both until the transport is dropped. A restarted
//! process of a failed rank calls [`TcpTransport::connect`] with the same configuration; its
//! registration (authenticated with the job token like the first ones) is answered at once
//! with the current address table and the session, and with what rank 0 knows of each rank:
//! up (connected to rank 0), joining (restarted and registered earlier, not yet connected to
//! rank 0) or down. The restarted process dials the ranks that are up or joining and accepts
//! the others on its own listener: of two ranks restarting together, the one that registers
//! later dials the earlier one, so each pair has exactly one dialer. A rank that accepts the
//! dial of a rank whose connection has failed (or that it never reached) replaces that
//! connection and revives the rank in its [`Mailbox`] ([`Mailbox::revive`]: frames from the
//! dead process still queued are dropped); a dial claiming a healthy rank is refused with a
//! line on stderr and the job goes on. A dial that a peer refuses (it has not yet seen the old
//! connection end) is retried until the rendezvous timeout; a rank that cannot be reached by
//! then, or that is down, is marked lost in the restarted process's mailbox
//! ([`Mailbox::mark_lost`]: only waits on it fail) until it dials in; reaching no other rank
//! at all is a [`CollectiveError::Rendezvous`] error. [`Transport::rejoined`] (and
//! [`ProcessGroup::rejoined`](crate::ProcessGroup::rejoined)) tell the restarted process apart. Rank 0 refuses a registration
//! for a rank it still sees healthy ("rank r is still running in this job"), for rank 0
//! itself, and for another world size or a process without rejoining on. Rank 0 cannot be
//! replaced, as it holds the store: once it is lost, no rank can rejoin, though the others may
//! go on. Failures stay as described above: only peers given to
//! [`Mailbox::isolate_failures_of`] can fail without ending every wait, so a job that means
//! to survive a rank's crash isolates the ranks it can lose; a failure that was not isolated
//! is final even after the rank rejoins. Every rank must agree on the flag: the store refuses
//! a first registration whose flag differs from rank 0's, with an error naming it.
//!
//! Security: the job token ([`JobToken`], `BURN_PARALLEL_JOB_TOKEN`, which `burnrun` generates
//! and hands to its ranks) authenticates every registration with rank 0's store and every data
//! connection, by an HMAC-SHA256 over a fresh challenge of the accepting side; the token itself
//! never crosses the wire. A process without the token (a stray connection, garbage, a forged or
//! replayed registration, one that connects and stays silent) is dropped with a line on stderr
//! and does not disturb the job; a rank whose token differs from rank 0's keeps retrying until
//! the rendezvous timeout, then fails with [`CollectiveError::JobToken`]. Without a token (a job
//! started by hand with no `BURN_PARALLEL_JOB_TOKEN`, or a [`TcpConfig`] without
//! [`TcpConfig::with_job_token`]) every rank works unauthenticated, as long as no rank has one:
//! [`init_from_env`](crate::world::init_from_env) prints a one-line warning, and a token on one side of the rendezvous and
//! none on the other is a [`CollectiveError::JobToken`] error. Authentication is not encryption:
//! the tensors travel in clear; use a private network. Rank 0 serves the store on the
//! `MASTER_ADDR` address only (not every interface); every other rank binds its data listener
//! on the local address of its connection to the store, the interface that reaches rank 0.
//!
//! Environment knobs: `BURN_PARALLEL_RENDEZVOUS_TIMEOUT_SECS` (rendezvous bound of
//! [`init_from_env`](crate::world::init_from_env), default 300 s), `BURN_PARALLEL_TIMEOUT_SECS` (also bounds a write to a
//! peer that stopped reading), both positive, finite and at most [`MAX_TIMEOUT`] (anything
//! else is a [`CollectiveError::InvalidTimeout`] error), `BURN_PARALLEL_TCP_SOCKET_BUFFER`
//! (bytes for `SO_SNDBUF` and `SO_RCVBUF`; unset or 0 keeps the kernel's auto-tuning),
//! `BURN_PARALLEL_JOB_TOKEN` (above), `BURN_PARALLEL_FAULT_TOLERANT` (`1` or `true` turns on
//! rejoining, above; `0`, `false` or unset leave it off; anything else is a
//! [`CollectiveError::Rendezvous`] error naming it).

mod auth;
pub(crate) mod env;
mod rendezvous;
mod wire;

use std::io::BufReader;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

pub use auth::{JOB_TOKEN_ENV, JobToken};
pub use env::{
    DEFAULT_MASTER_PORT, DEFAULT_RENDEZVOUS_TIMEOUT, FAULT_TOLERANT_ENV, LaunchEnv, Launcher,
};

pub use crate::comm::transport::MAX_TIMEOUT;

use crate::comm::transport::DEFAULT_TIMEOUT;
use crate::comm::transport::{Frame, Mailbox, Transport};
use crate::error::{CollectiveError, Result};

/// How long [`Drop`] waits for the peers to close their side after our goodbye, so that no
/// unread byte turns the close into a reset.
const LINGER: Duration = Duration::from_secs(2);
/// The linger of a rank whose world has failed.
const FAILED_LINGER: Duration = Duration::from_millis(200);
/// Longest wait for the writer lock and the socket when sending an abort or a goodbye.
const CONTROL_WAIT: Duration = Duration::from_secs(1);
/// Read buffer of a reader thread (large payloads bypass it).
const READ_BUFFER: usize = 256 * 1024;

/// How to join a `tcp` world.
///
/// # Example
/// ```no_run
/// use std::time::Duration;
/// use burn_parallel::comm::tcp::TcpConfig;
/// use burn_parallel::world::connect_tcp;
/// // On each of 2 processes, with its own rank:
/// let config = TcpConfig::new(0, 2, "10.0.0.1", 29500).with_timeout(Duration::from_secs(60));
/// let group = connect_tcp(&config)?;
/// # Ok::<(), burn_parallel::CollectiveError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpConfig {
    /// Global rank of this process, in `0..world_size`.
    pub rank: usize,
    /// Number of processes in the world.
    pub world_size: usize,
    /// Host (name or address) where rank 0 serves the rendezvous.
    pub master_addr: String,
    /// Port of the rendezvous.
    pub master_port: u16,
    /// Bound on the whole rendezvous (registration, address table, mesh); positive and at
    /// most [`MAX_TIMEOUT`].
    pub timeout: Duration,
    /// The job's secret: when set, every registration and data connection must prove it
    /// (see the module documentation). Every rank needs the same one, or none.
    pub job_token: Option<JobToken>,
    /// Fault tolerance: once the world is formed, rank 0 keeps serving the rendezvous and
    /// every rank keeps listening, so that a restarted process of a failed rank (started with
    /// the same configuration) can take its place (see the module documentation). Every rank
    /// needs the same value. Off by default; `BURN_PARALLEL_FAULT_TOLERANT=1` turns it on in
    /// [`TcpConfig::from_env`].
    pub rejoin: bool,
}

impl TcpConfig {
    /// A configuration with the default timeout ([`DEFAULT_RENDEZVOUS_TIMEOUT`]) and no job
    /// token (an unauthenticated world; see [`TcpConfig::with_job_token`]).
    pub fn new(
        rank: usize,
        world_size: usize,
        master_addr: impl Into<String>,
        master_port: u16,
    ) -> Self {
        Self {
            rank,
            world_size,
            master_addr: master_addr.into(),
            master_port,
            timeout: DEFAULT_RENDEZVOUS_TIMEOUT,
            job_token: None,
            rejoin: false,
        }
    }

    /// The same configuration with rejoining on or off ([`TcpConfig::rejoin`]; every rank
    /// needs the same value).
    ///
    /// # Example
    /// ```
    /// use burn_parallel::comm::tcp::TcpConfig;
    /// let config = TcpConfig::new(1, 4, "127.0.0.1", 29500).with_rejoin(true);
    /// assert!(config.rejoin);
    /// ```
    pub fn with_rejoin(mut self, on: bool) -> Self {
        self.rejoin = on;
        self
    }

    /// The same configuration with another rendezvous timeout. A timeout of zero or longer
    /// than [`MAX_TIMEOUT`] makes [`connect_tcp`](crate::world::connect_tcp) fail with [`CollectiveError::InvalidTimeout`].
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The same configuration authenticated with `token` (every rank needs the same one).
    ///
    /// # Example
    /// ```
    /// use burn_parallel::comm::tcp::{JobToken, TcpConfig};
    /// let token = JobToken::new("a long random secret shared by the ranks")?;
    /// let config = TcpConfig::new(1, 2, "127.0.0.1", 29500).with_job_token(token);
    /// assert!(config.job_token.is_some());
    /// # Ok::<(), burn_parallel::CollectiveError>(())
    /// ```
    pub fn with_job_token(mut self, token: JobToken) -> Self {
        self.job_token = Some(token);
        self
    }

    /// The configuration described by the launcher's environment (see [`LaunchEnv`]); the
    /// timeout comes from `BURN_PARALLEL_RENDEZVOUS_TIMEOUT_SECS` (default 300 s), the job
    /// token from `BURN_PARALLEL_JOB_TOKEN`, and [`TcpConfig::rejoin`] from
    /// `BURN_PARALLEL_FAULT_TOLERANT` (`1` or `true`). Without a token, and with more than one rank, it
    /// prints a one-line warning: the world will be unauthenticated.
    ///
    /// # Errors
    /// [`CollectiveError::Rendezvous`] naming the missing or garbled variable (also
    /// `BURN_PARALLEL_FAULT_TOLERANT` set to anything but `1`, `true`, `0`, `false` or empty);
    /// [`CollectiveError::InvalidTimeout`] for a timeout that is not a positive number of
    /// seconds up to [`MAX_TIMEOUT`]; [`CollectiveError::JobToken`] for an empty token.
    pub fn from_env() -> Result<Self> {
        let env = LaunchEnv::from_env()?;
        // The processes of this node share its cores (the intra-op thread policy).
        crate::threads::launch(env.local_world_size.unwrap_or(1), true);
        let mut config = Self::from_launch_env(&env)
            .with_timeout(env::rendezvous_timeout_from_env()?)
            .with_rejoin(env::fault_tolerant_from_env()?);
        match JobToken::from_env() {
            Ok(Some(token)) => config.job_token = Some(token),
            Ok(None) if env.world_size > 1 => eprintln!(
                "burn-parallel rank {}: {JOB_TOKEN_ENV} is not set, so the rendezvous is not \
                 authenticated (any process that reaches MASTER_ADDR:MASTER_PORT can join or \
                 fail the job); burnrun sets one, or set the same secret on every rank",
                env.rank
            ),
            Ok(None) => {}
            Err(CollectiveError::JobToken { reason, .. }) => {
                return Err(CollectiveError::JobToken {
                    rank: env.rank,
                    reason,
                });
            }
            Err(e) => return Err(e),
        }
        Ok(config)
    }

    /// The configuration of a [`LaunchEnv`], with the default timeout.
    pub fn from_launch_env(env: &LaunchEnv) -> Self {
        Self::new(
            env.rank,
            env.world_size,
            env.master_addr.clone(),
            env.master_port,
        )
    }

    fn validate(&self) -> Result<()> {
        if self.world_size == 0 {
            return Err(CollectiveError::Rendezvous(
                "the world size must be at least 1".into(),
            ));
        }
        if self.rank >= self.world_size {
            return Err(CollectiveError::Rendezvous(format!(
                "rank {} is out of range for a world of {} ranks; ranks are 0..{}",
                self.rank, self.world_size, self.world_size
            )));
        }
        env::check_timeout("TcpConfig::timeout", self.timeout)?;
        Ok(())
    }
}

/// Rank 0's rendezvous listener, bound ahead of
/// [`connect_tcp_with_rendezvous`](crate::world::connect_tcp_with_rendezvous): bind it on port 0
/// and hand [`TcpRendezvous::port`] to the other ranks, so that tests never race for a port.
///
/// # Example
/// ```
/// use std::time::Duration;
/// use burn_parallel::comm::tcp::{TcpConfig, TcpRendezvous};
/// use burn_parallel::world::{connect_tcp, connect_tcp_with_rendezvous};
/// let rendezvous = TcpRendezvous::bind("127.0.0.1:0").unwrap();
/// let port = rendezvous.port();
/// let other = std::thread::spawn(move || {
///     connect_tcp(&TcpConfig::new(1, 2, "127.0.0.1", port).with_timeout(Duration::from_secs(10)))
/// });
/// let config = TcpConfig::new(0, 2, "127.0.0.1", port).with_timeout(Duration::from_secs(10));
/// let group = connect_tcp_with_rendezvous(&config, rendezvous).unwrap();
/// let peer = other.join().unwrap().unwrap();
/// assert_eq!((group.rank(), peer.rank(), group.size()), (0, 1, 2));
/// ```
#[derive(Debug)]
pub struct TcpRendezvous {
    listener: TcpListener,
}

impl TcpRendezvous {
    /// Binds the rendezvous listener (`"0.0.0.0:29500"`, or port 0 for any free port).
    ///
    /// # Errors
    /// [`CollectiveError::Rendezvous`] when the address cannot be resolved or bound.
    pub fn bind(addr: impl ToSocketAddrs + std::fmt::Debug) -> Result<Self> {
        TcpListener::bind(&addr)
            .map(|listener| Self { listener })
            .map_err(|e| {
                CollectiveError::Rendezvous(format!(
                    "cannot listen for the rendezvous on {addr:?}: {e} (is another job using \
                     this MASTER_PORT? pick another one)"
                ))
            })
    }

    /// The bound address.
    ///
    /// # Errors
    /// [`CollectiveError::Rendezvous`] if the socket cannot report it.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.listener
            .local_addr()
            .map_err(|e| CollectiveError::Rendezvous(format!("rendezvous listener: {e}")))
    }

    /// The bound port (the one to pass as `MASTER_PORT`).
    pub fn port(&self) -> u16 {
        self.listener.local_addr().map(|a| a.port()).unwrap_or(0)
    }
}

/// Rank 0's rendezvous listener on the `MASTER_ADDR` address itself (the first of its
/// addresses that binds, for a name), not on every interface: the store is reachable only
/// through the interface the job uses.
///
/// # Errors
/// [`CollectiveError::Rendezvous`] when `MASTER_ADDR` does not resolve, when none of its
/// addresses belongs to this machine (rank 0 must run on the `MASTER_ADDR` host), or when the
/// port is taken.
fn bind_store(config: &TcpConfig) -> Result<TcpRendezvous> {
    let (host, port) = (config.master_addr.as_str(), config.master_port);
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| {
            CollectiveError::Rendezvous(format!("cannot resolve MASTER_ADDR {host:?}: {e}"))
        })?
        .collect();
    let mut not_local = Vec::new();
    let mut other = None;
    for addr in &addrs {
        match TcpListener::bind(addr) {
            Ok(listener) => return Ok(TcpRendezvous { listener }),
            Err(e) if e.kind() == std::io::ErrorKind::AddrNotAvailable => not_local.push(*addr),
            Err(e) => {
                other.get_or_insert((*addr, e));
            }
        }
    }
    Err(CollectiveError::Rendezvous(match other {
        Some((addr, e)) => format!(
            "rank 0 cannot listen for the rendezvous on {addr} (MASTER_ADDR {host:?}): {e} (is \
             another job using this MASTER_PORT? pick another one)"
        ),
        None if not_local.is_empty() => format!("MASTER_ADDR {host:?} resolves to no address"),
        None => format!(
            "MASTER_ADDR {host:?} ({}) is not an address of this machine, so rank 0 cannot \
             serve the rendezvous on it: run rank 0 on the host MASTER_ADDR names, or set \
             MASTER_ADDR to an address of rank 0's host that the other ranks reach",
            not_local
                .iter()
                .map(|a| a.ip().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }))
}

/// The stall timeout of writes: `BURN_PARALLEL_TIMEOUT_SECS` or [`DEFAULT_TIMEOUT`].
///
/// # Errors
/// [`CollectiveError::InvalidTimeout`] when the variable is set to an unusable value.
fn io_timeout() -> Result<Duration> {
    Ok(env::timeout_from_env("BURN_PARALLEL_TIMEOUT_SECS")?.unwrap_or(DEFAULT_TIMEOUT))
}

/// `BURN_PARALLEL_TCP_SOCKET_BUFFER`, when set to a positive number of bytes.
fn socket_buffer() -> Option<usize> {
    std::env::var("BURN_PARALLEL_TCP_SOCKET_BUFFER")
        .ok()
        .and_then(|s| s.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
}

/// What a reader thread learned about its peer, read by senders.
#[derive(Default)]
struct PeerStatus {
    /// Why sending to the peer must fail (it said goodbye, or the connection is lost).
    gone: Mutex<Option<String>>,
    /// This side is closing: the end of the stream is expected, not a failure.
    closing: AtomicBool,
}

impl PeerStatus {
    fn set_gone(&self, why: String) {
        let mut gone = self.gone.lock().unwrap_or_else(|e| e.into_inner());
        gone.get_or_insert(why);
    }

    fn gone(&self) -> Option<String> {
        self.gone.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// This rank's connection to one peer.
struct Peer {
    /// Sends are serialised per peer: a frame is written whole before the next.
    writer: Mutex<TcpStream>,
    /// Another handle on the socket, to shut it down without taking the writer lock.
    control: TcpStream,
    status: Arc<PeerStatus>,
    reader: Mutex<Option<JoinHandle<()>>>,
}

impl Peer {
    fn reader_running(&self) -> bool {
        self.reader
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .is_some_and(|r| !r.is_finished())
    }

    /// Closes the connection on purpose (its end is not a failure) and joins the reader.
    fn retire(&self) {
        self.status.closing.store(true, Ordering::SeqCst);
        let _ = self.control.shutdown(Shutdown::Both);
        let reader = self.reader.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(reader) = reader {
            let _ = reader.join();
        }
    }
}

/// What the transport shares with its background threads (the store and the data listener
/// of a world with rejoining on).
struct Shared {
    rank: usize,
    world_size: usize,
    mailbox: Arc<Mailbox>,
    /// The connection to each peer (`None` at this rank's index, and for a peer this rank has
    /// not reached); replaced when a restarted peer reconnects.
    peers: Vec<RwLock<Option<Arc<Peer>>>>,
    io_timeout: Duration,
    socket_buffer: Option<usize>,
}

impl Shared {
    fn new(rank: usize, world_size: usize, io_timeout: Duration) -> Self {
        Self {
            rank,
            world_size,
            mailbox: Arc::new(Mailbox::new()),
            peers: (0..world_size).map(|_| RwLock::new(None)).collect(),
            io_timeout,
            socket_buffer: socket_buffer(),
        }
    }

    /// The current connection to `peer`.
    fn peer(&self, peer: usize) -> Option<Arc<Peer>> {
        self.peers
            .get(peer)?
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Every current connection.
    fn connected(&self) -> Vec<Arc<Peer>> {
        (0..self.world_size).filter_map(|p| self.peer(p)).collect()
    }

    /// Whether `peer` is connected and its connection healthy.
    fn up(&self, peer: usize) -> bool {
        self.peer(peer).is_some_and(|p| p.status.gone().is_none())
    }

    /// Configures a connected socket and starts its reader thread.
    fn open(&self, peer: usize, stream: TcpStream) -> Result<Peer> {
        let rank = self.rank;
        let setup_err = |e: std::io::Error| {
            CollectiveError::Rendezvous(format!(
                "rank {rank}: setting up the connection to rank {peer}: {e}"
            ))
        };
        stream.set_nodelay(true).map_err(setup_err)?;
        stream.set_read_timeout(None).map_err(setup_err)?;
        stream
            .set_write_timeout(Some(self.io_timeout))
            .map_err(setup_err)?;
        if let Some(bytes) = self.socket_buffer {
            let sock = socket2::SockRef::from(&stream);
            sock.set_send_buffer_size(bytes).map_err(setup_err)?;
            sock.set_recv_buffer_size(bytes).map_err(setup_err)?;
        }
        let control = stream.try_clone().map_err(setup_err)?;
        let reading = stream.try_clone().map_err(setup_err)?;
        let status = Arc::new(PeerStatus::default());
        let reader = {
            let mailbox = self.mailbox.clone();
            let status = status.clone();
            let shutdown = stream.try_clone().map_err(setup_err)?;
            let world_size = self.world_size;
            thread::Builder::new()
                .name(format!("burn-tcp-{rank}<-{peer}"))
                .spawn(move || read_loop(peer, world_size, reading, shutdown, &mailbox, &status))
                .map_err(|e| {
                    CollectiveError::Rendezvous(format!(
                        "rank {rank}: cannot start the reader thread of rank {peer}: {e}"
                    ))
                })?
        };
        Ok(Peer {
            writer: Mutex::new(stream),
            control,
            status,
            reader: Mutex::new(Some(reader)),
        })
    }

    /// A restarted `peer` connected: its new connection replaces the failed one (whose
    /// reader is joined), its state in the mailbox is revived, `answer` finishes the
    /// handshake (so the peer goes on only once this rank is ready for it), and a new reader
    /// starts. Refused (`Err`, the stream is dropped) while the current connection is healthy.
    fn replace(
        &self,
        peer: usize,
        mut stream: TcpStream,
        answer: rendezvous::Answer<'_>,
    ) -> std::result::Result<(), String> {
        let mut slot = self.peers[peer].write().unwrap_or_else(|e| e.into_inner());
        if slot.as_ref().is_some_and(|p| p.status.gone().is_none()) {
            return Err(format!(
                "claimed rank {peer}, which is connected and healthy (a rank is replaced only \
                 once its connection has failed)"
            ));
        }
        if let Some(old) = slot.take() {
            old.retire();
        }
        // No reader delivers from `peer` now: what is queued came from the dead process.
        self.mailbox.revive(peer);
        let opened = answer(&mut stream)
            .map_err(|e| format!("the handshake failed: {e}"))
            .and_then(|()| self.open(peer, stream).map_err(|e| e.to_string()));
        match opened {
            Ok(new) => {
                *slot = Some(Arc::new(new));
                Ok(())
            }
            Err(e) => {
                let reason = format!("rank {peer} reconnected, but its connection failed: {e}");
                self.mailbox.mark_failed(peer, &reason);
                Err(reason)
            }
        }
    }

    /// Marks `peer` lost in the mailbox unless it is connected (a later restarted rank may
    /// have dialed this one meanwhile).
    fn mark_lost_unless_up(&self, peer: usize, reason: &str) {
        let slot = self.peers[peer].write().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            self.mailbox.mark_lost(peer, reason);
        }
    }
}

/// One rank's end of a `tcp` world: a connection to every other rank, each with a reader
/// thread that fills this rank's [`Mailbox`].
///
/// Obtained through [`connect_tcp`](crate::world::connect_tcp) or [`init_from_env`](crate::world::init_from_env) (as a [`ProcessGroup`](crate::ProcessGroup)) or
/// [`TcpTransport::connect`]. Dropping it says goodbye to every peer (or, when dropped while a
/// panic unwinds, reports this rank as failed), waits briefly for them to close their side, and
/// joins the reader threads. A process that exits without dropping it (for example through
/// `std::process::exit`) is reported as crashed by its peers. With [`TcpConfig::rejoin`], it
/// also keeps a data listener (and, on rank 0, the rendezvous store) open for restarted ranks
/// until it is dropped.
pub struct TcpTransport {
    shared: Arc<Shared>,
    /// This process joined a world that was already running.
    rejoined: bool,
    /// Ends the background threads.
    stop: Arc<AtomicBool>,
    /// The store (rank 0) and data-listener threads of a world with rejoining on.
    background: Mutex<Vec<JoinHandle<()>>>,
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTransport")
            .field("rank", &self.shared.rank)
            .field("world_size", &self.shared.world_size)
            .field("rejoined", &self.rejoined)
            .finish()
    }
}

impl TcpTransport {
    /// Forms the world described by `config` (see [`connect_tcp`](crate::world::connect_tcp)); `rendezvous` is rank 0's
    /// listener bound beforehand, or `None` to bind `master_addr:master_port`.
    ///
    /// With [`TcpConfig::rejoin`], a rank whose registration finds the world already running
    /// (a restarted process) joins it instead: see the module documentation, and
    /// [`Transport::rejoined`].
    ///
    /// # Errors
    /// As [`connect_tcp`](crate::world::connect_tcp); also when a rendezvous listener is given to a rank other than 0.
    /// A restarted rank gets [`CollectiveError::Rendezvous`] when rank 0 refuses it (the rank
    /// is still running, it is rank 0, its world size or rejoin flag differs) or when it
    /// reaches no other rank before the timeout.
    pub fn connect(config: &TcpConfig, rendezvous: Option<TcpRendezvous>) -> Result<Arc<Self>> {
        config.validate()?;
        let deadline = env::deadline_after("TcpConfig::timeout", config.timeout)?;
        // Checked now: an unusable value is an error before any connection is made.
        let io_timeout = io_timeout()?;
        let (rank, world_size) = (config.rank, config.world_size);
        let token = config.job_token.as_ref();
        if rendezvous.is_some() && rank != 0 {
            return Err(CollectiveError::Rendezvous(format!(
                "rank {rank} was given a rendezvous listener; only rank 0 serves the rendezvous"
            )));
        }
        if world_size == 1 {
            return Self::start(rank, world_size, vec![None], io_timeout).map(Arc::new);
        }
        if rank == 0 {
            let store = match rendezvous {
                Some(store) => store,
                None => bind_store(config).map_err(|e| match e {
                    CollectiveError::Rendezvous(m) if config.rejoin => {
                        CollectiveError::Rendezvous(format!(
                            "{m}; with rejoining on, rank 0 cannot be replaced: if a rank 0 of \
                             this job still runs, it holds the store (restart the whole job to \
                             replace rank 0)"
                        ))
                    }
                    other => other,
                })?,
            };
            let store_ip = store.local_addr()?.ip();
            // Nobody dials rank 0 to form the world (it dials everyone), but the mesh code is
            // the same for all, and restarted ranks dial it.
            let data = rendezvous::bind_data_listener(store_ip)?;
            let own = rendezvous::rank0_data_addr(&store.listener, &data);
            let (session, addrs) = rendezvous::serve_store(
                &store.listener,
                world_size,
                own,
                token,
                config.rejoin,
                deadline,
                config.timeout,
            )?;
            // Without rejoining, the store closes once the world is formed.
            let store = config.rejoin.then_some(store);
            let mesh =
                rendezvous::form_mesh(rank, world_size, session, &data, &addrs, token, deadline)?;
            let transport = Self::start(rank, world_size, mesh, io_timeout)?;
            if let Some(store) = store {
                transport.serve_store(store, session, addrs, config)?;
                transport.serve_dials(data, session, config)?;
            }
            return Ok(Arc::new(transport));
        }
        let (data, joined) = rendezvous::register(
            rank,
            world_size,
            &config.master_addr,
            config.master_port,
            token,
            config.rejoin,
            deadline,
            config.timeout,
        )?;
        match joined {
            rendezvous::Joined::Forming { session, addrs } => {
                let mesh = rendezvous::form_mesh(
                    rank, world_size, session, &data, &addrs, token, deadline,
                )?;
                let transport = Self::start(rank, world_size, mesh, io_timeout)?;
                if config.rejoin {
                    transport.serve_dials(data, session, config)?;
                }
                Ok(Arc::new(transport))
            }
            rendezvous::Joined::Running {
                session,
                addrs,
                states,
            } => Self::rejoin(config, data, session, &addrs, &states, deadline, io_timeout)
                .map(Arc::new),
        }
    }

    /// A transport with no connection yet.
    fn empty(rank: usize, world_size: usize, io_timeout: Duration) -> Self {
        Self {
            shared: Arc::new(Shared::new(rank, world_size, io_timeout)),
            rejoined: false,
            stop: Arc::new(AtomicBool::new(false)),
            background: Mutex::new(Vec::new()),
        }
    }

    /// Configures the connected sockets and starts the reader threads.
    fn start(
        rank: usize,
        world_size: usize,
        mesh: Vec<Option<TcpStream>>,
        io_timeout: Duration,
    ) -> Result<Self> {
        let transport = Self::empty(rank, world_size, io_timeout);
        for (peer, stream) in mesh.into_iter().enumerate() {
            if let Some(stream) = stream {
                let opened = transport.shared.open(peer, stream)?;
                *transport.shared.peers[peer]
                    .write()
                    .unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(opened));
            }
        }
        Ok(transport)
    }

    /// The restarted process of rank `config.rank` joins the running world: it listens for
    /// the restarted ranks that register after it, dials the ranks rank 0 listed as up or
    /// joining, and marks the others lost until they dial it.
    fn rejoin(
        config: &TcpConfig,
        data: TcpListener,
        session: u64,
        addrs: &[SocketAddr],
        states: &[rendezvous::RankState],
        deadline: Instant,
        io_timeout: Duration,
    ) -> Result<Self> {
        let (rank, world_size) = (config.rank, config.world_size);
        let token = config.job_token.as_ref();
        let mut transport = Self::empty(rank, world_size, io_timeout);
        transport.rejoined = true;
        transport.serve_dials(data, session, config)?;
        let targets: Vec<usize> = (0..world_size)
            .filter(|&p| p != rank && states[p] != rendezvous::RankState::Down)
            .collect();
        let stop = &*transport.stop;
        let dialed: Vec<(usize, std::result::Result<TcpStream, String>)> = thread::scope(|scope| {
            let handles: Vec<_> = targets
                .iter()
                .map(|&p| {
                    let link = rendezvous::link(session, world_size, rank, p);
                    let addr = addrs[p];
                    (
                        p,
                        scope.spawn(move || {
                            rendezvous::dial_until(link, addr, token, deadline, stop)
                        }),
                    )
                })
                .collect();
            handles
                .into_iter()
                .map(|(p, h)| {
                    let result = h
                        .join()
                        .unwrap_or_else(|_| Err("the dialing thread panicked".into()));
                    (p, result)
                })
                .collect()
        });
        let mut unreachable = Vec::new();
        for (p, result) in dialed {
            match result {
                Ok(stream) => {
                    if let Err(why) = transport.shared.replace(p, stream, &mut |_| Ok(())) {
                        eprintln!(
                            "burn-parallel rank {rank}: dropped the connection to rank {p}: {why}"
                        );
                    }
                }
                Err(e) => {
                    let reason =
                        format!("rank {rank} rejoined the job but could not reach rank {p}: {e}");
                    transport.shared.mark_lost_unless_up(p, &reason);
                    unreachable.push(reason);
                }
            }
        }
        for p in (0..world_size).filter(|&p| p != rank && !targets.contains(&p)) {
            transport.shared.mark_lost_unless_up(
                p,
                &format!(
                    "rank {p} was down when rank {rank} rejoined the job; it connects to rank \
                     {rank} when it restarts"
                ),
            );
        }
        if !(0..world_size).any(|p| transport.shared.up(p)) {
            return Err(CollectiveError::Rendezvous(format!(
                "rank {rank}: rank 0 let this process rejoin the running job, but it reached \
                 no other rank before the rendezvous timeout of {:?}: {}",
                config.timeout,
                unreachable.join("; ")
            )));
        }
        for reason in &unreachable {
            eprintln!("burn-parallel rank {rank}: {reason}; going on without it");
        }
        Ok(transport)
    }

    /// Rank 0 keeps serving the rendezvous store for restarted ranks (rejoining on).
    fn serve_store(
        &self,
        store: TcpRendezvous,
        session: u64,
        addrs: Vec<SocketAddr>,
        config: &TcpConfig,
    ) -> Result<()> {
        let shared = self.shared.clone();
        let stop = self.stop.clone();
        let token = config.job_token.clone();
        let join_window = config.timeout;
        let world_size = self.shared.world_size;
        self.spawn("burn-tcp-store", move || {
            rendezvous::serve_running_store(
                rendezvous::RunningStore {
                    store: &store.listener,
                    world_size,
                    token: token.as_ref(),
                    session,
                    addrs,
                    join_window,
                    stop: &stop,
                },
                &|r| shared.up(r),
            );
        })
    }

    /// Keeps accepting restarted ranks on this rank's data listener (rejoining on).
    fn serve_dials(&self, data: TcpListener, session: u64, config: &TcpConfig) -> Result<()> {
        let shared = self.shared.clone();
        let stop = self.stop.clone();
        let token = config.job_token.clone();
        let name = format!("burn-tcp-rejoin-{}", self.shared.rank);
        self.spawn(&name, move || {
            rendezvous::serve_rejoin_dials(
                rendezvous::RejoinListener {
                    rank: shared.rank,
                    world_size: shared.world_size,
                    session,
                    listener: &data,
                    token: token.as_ref(),
                    stop: &stop,
                },
                &mut |peer, stream, answer| {
                    shared.replace(peer, stream, answer)?;
                    eprintln!(
                        "burn-parallel rank {}: rank {peer} reconnected (a restarted process)",
                        shared.rank
                    );
                    Ok(())
                },
            );
        })
    }

    fn spawn(&self, name: &str, f: impl FnOnce() + Send + 'static) -> Result<()> {
        let handle = thread::Builder::new()
            .name(name.to_string())
            .spawn(f)
            .map_err(|e| {
                CollectiveError::Rendezvous(format!(
                    "rank {}: cannot start the thread {name}: {e}",
                    self.shared.rank
                ))
            })?;
        self.background
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(handle);
        Ok(())
    }

    /// Stops the store and data-listener threads (their listeners close).
    fn stop_background(&self) {
        self.stop.store(true, Ordering::SeqCst);
        let handles =
            std::mem::take(&mut *self.background.lock().unwrap_or_else(|e| e.into_inner()));
        for handle in handles {
            let _ = handle.join();
        }
    }

    /// Cuts every connection at once, without a goodbye, as if this process had crashed:
    /// peers report this rank as failed. Meant for fault-injection tests; the transport is
    /// unusable afterwards (its listeners are closed too, so the rank can be restarted).
    pub fn disconnect_abruptly(&self) {
        self.stop_background();
        for peer in self.shared.connected() {
            peer.status.closing.store(true, Ordering::SeqCst);
            peer.status
                .set_gone("this rank disconnected abruptly".to_string());
            let _ = peer.control.shutdown(Shutdown::Both);
        }
    }

    /// Locks `peer`'s writer, giving up after [`CONTROL_WAIT`] (another thread may be stuck in
    /// a large write to a peer that stopped reading).
    fn lock_writer_briefly(peer: &Peer) -> Option<MutexGuard<'_, TcpStream>> {
        let deadline = Instant::now() + CONTROL_WAIT;
        loop {
            match peer.writer.try_lock() {
                Ok(guard) => return Some(guard),
                Err(std::sync::TryLockError::Poisoned(e)) => return Some(e.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) if Instant::now() < deadline => {
                    thread::sleep(Duration::from_millis(1));
                }
                Err(std::sync::TryLockError::WouldBlock) => return None,
            }
        }
    }

    fn transport_error(&self, peer: usize, reason: String) -> CollectiveError {
        CollectiveError::Transport {
            rank: self.shared.rank,
            peer,
            reason,
        }
    }
}

impl Transport for TcpTransport {
    fn rank(&self) -> usize {
        self.shared.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world_size
    }

    fn backend_name(&self) -> &'static str {
        "tcp"
    }

    fn rejoined(&self) -> bool {
        self.rejoined
    }

    fn send(&self, dst: usize, frame: Frame) -> Result<()> {
        let rank = self.shared.rank;
        let mailbox = &self.shared.mailbox;
        if dst == rank {
            mailbox.deliver(rank, frame);
            return Ok(());
        }
        if dst >= self.shared.world_size {
            return Err(self.transport_error(
                dst,
                format!(
                    "no rank {dst} in a tcp world of {} ranks",
                    self.shared.world_size
                ),
            ));
        }
        let Some(peer) = self.shared.peer(dst) else {
            return Err(CollectiveError::PeerFailed {
                rank,
                op: format!("send to rank {dst}"),
                peer: dst,
                reason: format!(
                    "rank {dst} is not connected to this rank (it was down or unreachable when \
                     this rank rejoined the job, and has not reconnected)"
                ),
            });
        };
        if let Some(why) = peer.status.gone() {
            // Report the root cause, as a receive would.
            let (failed, reason) = mailbox.failure().unwrap_or((dst, why));
            return Err(CollectiveError::PeerFailed {
                rank,
                op: format!("send to rank {dst}"),
                peer: failed,
                reason,
            });
        }
        wire::check_encodable(&frame)
            .map_err(|why| self.transport_error(dst, format!("cannot send this frame: {why}")))?;
        let mut writer = peer.writer.lock().unwrap_or_else(|e| e.into_inner());
        let Err(e) = wire::write_data(&mut *writer, &frame) else {
            return Ok(());
        };
        drop(writer);
        // A frame may have been cut in the middle: the connection is unusable.
        let stalled = matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        );
        let reason = if stalled {
            format!(
                "rank {dst} stopped reading: a write to it made no progress for {:?}",
                self.shared.io_timeout
            )
        } else {
            // The peer is gone. Let the reader drain what it sent last (an abort naming the
            // root cause, a goodbye) before blaming the connection.
            let _ = peer.control.shutdown(Shutdown::Write);
            let deadline = Instant::now() + Duration::from_millis(200);
            while peer.reader_running() && Instant::now() < deadline {
                thread::sleep(Duration::from_millis(1));
            }
            format!("connection to rank {dst} lost (process exited or crashed): {e}")
        };
        let _ = peer.control.shutdown(Shutdown::Both);
        let (failed, reason) = match (mailbox.failure(), peer.status.gone()) {
            (Some(root), _) => root,
            // It said goodbye: sending to it is this program's error, not a failure of it.
            (None, Some(goodbye)) if !stalled => (dst, goodbye),
            (None, _) => {
                peer.status.set_gone(reason.clone());
                mailbox.mark_failed(dst, &reason);
                (dst, reason)
            }
        };
        Err(CollectiveError::PeerFailed {
            rank,
            op: format!("send to rank {dst}"),
            peer: failed,
            reason,
        })
    }

    fn mailbox(&self) -> &Mailbox {
        &self.shared.mailbox
    }

    fn abort(&self, reason: &str) {
        let rank = self.shared.rank;
        let mailbox = &self.shared.mailbox;
        // When this rank fails because another one did, pass on the root cause: every rank
        // then names the same culprit, whichever abort reaches it first.
        let (origin, reason) = match mailbox.failure() {
            Some((origin, root)) if origin != rank => (origin, root),
            _ => (rank, reason.to_string()),
        };
        mailbox.mark_failed(rank, &reason);
        for peer in self.shared.connected() {
            match Self::lock_writer_briefly(&peer) {
                Some(mut writer) => {
                    let _ = writer.set_write_timeout(Some(CONTROL_WAIT));
                    if wire::write_abort(&mut *writer, origin, &reason).is_err() {
                        let _ = peer.control.shutdown(Shutdown::Both);
                    }
                    let _ = writer.set_write_timeout(Some(self.shared.io_timeout));
                }
                // Cannot get a whole frame through: cutting the connection still tells the
                // peer that this rank is gone.
                None => {
                    let _ = peer.control.shutdown(Shutdown::Both);
                }
            }
        }
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        // No restarted rank replaces a connection from now on.
        self.stop_background();
        // Dropped while unwinding from a panic: this rank failed, it did not finish.
        if thread::panicking() {
            self.abort(&format!(
                "rank {} panicked (its process group was dropped while unwinding)",
                self.shared.rank
            ));
        }
        let peers = self.shared.connected();
        // Say goodbye and close our sending side; what was written before still arrives.
        for peer in &peers {
            peer.status.closing.store(true, Ordering::SeqCst);
            if let Some(mut writer) = Self::lock_writer_briefly(peer) {
                let _ = writer.set_write_timeout(Some(CONTROL_WAIT));
                let _ = wire::write_goodbye(&mut *writer);
            }
            let _ = peer.control.shutdown(Shutdown::Write);
        }
        // Let the peers close their side (the readers keep draining meanwhile), then cut what
        // is left so that every reader thread ends.
        // A failed world may never close its side: keep only a short linger for the abort
        // frames to leave.
        let linger = if self.shared.mailbox.failure().is_some() {
            FAILED_LINGER
        } else {
            LINGER
        };
        let deadline = Instant::now() + linger;
        while Instant::now() < deadline && peers.iter().any(|p| p.reader_running()) {
            thread::sleep(Duration::from_millis(1));
        }
        for peer in &peers {
            let _ = peer.control.shutdown(Shutdown::Both);
            let reader = peer.reader.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(reader) = reader {
                let _ = reader.join();
            }
        }
    }
}

/// The reader thread of the connection to `peer`: delivers frames until the connection ends.
fn read_loop(
    peer: usize,
    world_size: usize,
    stream: TcpStream,
    shutdown: TcpStream,
    mailbox: &Mailbox,
    status: &PeerStatus,
) {
    let mut reader = BufReader::with_capacity(READ_BUFFER, stream);
    let mut said_goodbye = false;
    loop {
        match wire::read_frame(&mut reader) {
            Ok(Some(wire::Incoming::Data(frame))) => mailbox.deliver(peer, frame),
            Ok(Some(wire::Incoming::Goodbye)) => {
                said_goodbye = true;
                status.set_gone(format!("rank {peer} has shut down its process group"));
                mailbox.mark_closed(peer);
            }
            // The peer is still connected (its frames may still arrive): only mark it failed.
            Ok(Some(wire::Incoming::Abort { origin, reason })) => {
                let Some(origin) = usize::try_from(origin).ok().filter(|&o| o < world_size) else {
                    let reason = format!(
                        "malformed frame from rank {peer}: abort from rank {origin}, out of range"
                    );
                    status.set_gone(reason.clone());
                    mailbox.mark_failed(peer, &reason);
                    let _ = shutdown.shutdown(Shutdown::Both);
                    return;
                };
                mailbox.mark_failed(origin, &reason);
                if origin != peer {
                    mailbox.mark_failed(
                        peer,
                        &format!("rank {peer} stopped because rank {origin} failed: {reason}"),
                    );
                }
            }
            Ok(None) | Err(wire::ReadError::Io(_))
                if said_goodbye || status.closing.load(Ordering::SeqCst) =>
            {
                return;
            }
            Ok(None) => {
                let reason = format!("connection to rank {peer} lost (process exited or crashed)");
                status.set_gone(reason.clone());
                mailbox.mark_failed(peer, &reason);
                return;
            }
            Err(wire::ReadError::Io(e)) => {
                let reason =
                    format!("connection to rank {peer} lost (process exited or crashed): {e}");
                status.set_gone(reason.clone());
                mailbox.mark_failed(peer, &reason);
                return;
            }
            Err(wire::ReadError::Malformed(what)) => {
                let reason = format!("malformed frame from rank {peer}: {what}");
                status.set_gone(reason.clone());
                mailbox.mark_failed(peer, &reason);
                let _ = shutdown.shutdown(Shutdown::Both);
                return;
            }
        }
    }
}
