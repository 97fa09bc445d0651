//! Reading the launch environment of torchrun/burnrun or SLURM.

use std::time::{Duration, Instant};

use crate::comm::transport::MAX_TIMEOUT;
use crate::error::{CollectiveError, Result};

/// Port of the rendezvous when SLURM launched the job and `MASTER_PORT` is not set.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Bound on the rendezvous of [`init_from_env`](crate::world::init_from_env)(crate::world::init_from_env) unless
/// `BURN_PARALLEL_RENDEZVOUS_TIMEOUT_SECS` says otherwise.
pub const DEFAULT_RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(300);

/// Which launcher's variables described this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// `RANK`, `WORLD_SIZE`, ... as set by `burnrun` and `torchrun`.
    Torchrun,
    /// `SLURM_PROCID`, `SLURM_NTASKS`, ... as set by `srun`.
    Slurm,
}

/// Where this process sits in a job, as described by its launcher's environment variables.
///
/// Each value is read from torchrun's variable first, then from SLURM's:
///
/// | field | torchrun / burnrun | SLURM (fallback) |
/// |---|---|---|
/// | `rank` | `RANK` | `SLURM_PROCID` |
/// | `world_size` | `WORLD_SIZE` | `SLURM_NTASKS` |
/// | `local_rank` | `LOCAL_RANK` | `SLURM_LOCALID` |
/// | `local_world_size` | `LOCAL_WORLD_SIZE` | `SLURM_NTASKS_PER_NODE` (when a plain number) |
/// | `master_addr` | `MASTER_ADDR` | first host of `SLURM_JOB_NODELIST` (where task 0 runs with the default distribution) |
/// | `master_port` | `MASTER_PORT` | [`DEFAULT_MASTER_PORT`] |
///
/// The SLURM fallbacks for `MASTER_ADDR` and `MASTER_PORT` apply only under SLURM; with
/// torchrun's variables both are required.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// Global rank of this process.
    pub rank: usize,
    /// Number of processes in the job.
    pub world_size: usize,
    /// Rank of this process on its node (use it to pick a device), when the launcher says.
    pub local_rank: Option<usize>,
    /// Number of processes on this node, when the launcher says.
    pub local_world_size: Option<usize>,
    /// Host of rank 0's rendezvous.
    pub master_addr: String,
    /// Port of rank 0's rendezvous.
    pub master_port: u16,
    /// Which launcher's variables were read.
    pub launcher: Launcher,
}

fn parse<T: std::str::FromStr>(name: &str, value: &str, what: &str) -> Result<T> {
    value.trim().parse().map_err(|_| {
        CollectiveError::Rendezvous(format!(
            "{name}={value:?} is not a valid value: set {name} to {what}"
        ))
    })
}

/// The first host of a SLURM host list: `node[03-05,9],gpu1` gives `node03`.
pub(crate) fn first_host(nodelist: &str) -> Option<String> {
    let mut depth = 0usize;
    let mut end = nodelist.len();
    for (i, c) in nodelist.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                end = i;
                break;
            }
            _ => {}
        }
    }
    let mut host = nodelist[..end].trim().to_string();
    while let Some(open) = host.find('[') {
        let close = open + host[open..].find(']')?;
        let first = host[open + 1..close].split(',').next()?.split('-').next()?;
        host = format!("{}{}{}", &host[..open], first, &host[close + 1..]);
    }
    (!host.is_empty()).then_some(host)
}

impl LaunchEnv {
    /// Reads the process's environment (see the table on [`LaunchEnv`]).
    ///
    /// # Errors
    /// [`CollectiveError::Rendezvous`] naming the first variable that is missing or garbled,
    /// and what to set it to.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Like [`LaunchEnv::from_env`], reading variables through `lookup` (for tests and for
    /// programs that take their settings from elsewhere).
    ///
    /// # Errors
    /// As [`LaunchEnv::from_env`].
    ///
    /// # Example
    /// ```
    /// use burn_parallel::comm::tcp::{LaunchEnv, Launcher};
    /// let vars = [("SLURM_PROCID", "3"), ("SLURM_NTASKS", "8"), ("SLURM_JOB_NODELIST", "gpu[07-08]")];
    /// let env = LaunchEnv::from_lookup(|name| {
    ///     vars.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string())
    /// })
    /// .unwrap();
    /// assert_eq!((env.rank, env.world_size, env.launcher), (3, 8, Launcher::Slurm));
    /// assert_eq!((env.master_addr.as_str(), env.master_port), ("gpu07", 29500));
    /// ```
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let get = |name: &str| lookup(name).filter(|v| !v.trim().is_empty());
        let launcher = if get("RANK").is_none() && get("SLURM_PROCID").is_some() {
            Launcher::Slurm
        } else {
            Launcher::Torchrun
        };
        // The value of the first variable of `names` that is set, with its name.
        let first = |names: &[&'static str]| names.iter().find_map(|&n| get(n).map(|v| (n, v)));
        let missing = |names: &[&str], what: &str| {
            let also = if names.len() > 1 {
                format!(" (nor {})", names[1..].join(", "))
            } else {
                String::new()
            };
            CollectiveError::Rendezvous(format!(
                "{} is not set{also}: start the program with burnrun (or torchrun, or srun), or \
                 set {} to {what}",
                names[0], names[0]
            ))
        };

        let rank_what = "this process's rank, in 0..WORLD_SIZE";
        let world_what = "the number of processes in the job (at least 1)";
        let (name, value) = first(&["RANK", "SLURM_PROCID"])
            .ok_or_else(|| missing(&["RANK", "SLURM_PROCID"], rank_what))?;
        let rank: usize = parse(name, &value, rank_what)?;
        let (world_name, value) = first(&["WORLD_SIZE", "SLURM_NTASKS"])
            .ok_or_else(|| missing(&["WORLD_SIZE", "SLURM_NTASKS"], world_what))?;
        let world_size: usize = parse(world_name, &value, world_what)?;
        if world_size == 0 {
            return Err(CollectiveError::Rendezvous(format!(
                "{world_name}=0: set {world_name} to {world_what}"
            )));
        }
        if rank >= world_size {
            return Err(CollectiveError::Rendezvous(format!(
                "{name}={rank} is out of range for {world_name}={world_size}: set {name} to \
                 {rank_what}"
            )));
        }
        let local_rank = match first(&["LOCAL_RANK", "SLURM_LOCALID"]) {
            Some((n, v)) => Some(parse(n, &v, "this process's rank on its node")?),
            None => None,
        };
        let local_world_size = match first(&["LOCAL_WORLD_SIZE"]) {
            Some((n, v)) => Some(parse(n, &v, "the number of processes on this node")?),
            None => get("SLURM_NTASKS_PER_NODE").and_then(|v| v.trim().parse().ok()),
        };

        let master_addr = match (get("MASTER_ADDR"), launcher) {
            (Some(addr), _) => addr.trim().to_string(),
            (None, Launcher::Slurm) => get("SLURM_JOB_NODELIST")
                .or_else(|| get("SLURM_NODELIST"))
                .and_then(|list| first_host(&list))
                .ok_or_else(|| {
                    missing(
                        &["MASTER_ADDR", "SLURM_JOB_NODELIST"],
                        "the host name or address of the node that runs rank 0",
                    )
                })?,
            (None, Launcher::Torchrun) => {
                return Err(missing(
                    &["MASTER_ADDR"],
                    "the host name or address of the node that runs rank 0",
                ));
            }
        };
        let port_what = "a free TCP port (1-65535) on the node of rank 0";
        let master_port = match (get("MASTER_PORT"), launcher) {
            (Some(port), _) => {
                let port: u16 = parse("MASTER_PORT", &port, port_what)?;
                if port == 0 {
                    return Err(CollectiveError::Rendezvous(format!(
                        "MASTER_PORT=0: set MASTER_PORT to {port_what}"
                    )));
                }
                port
            }
            (None, Launcher::Slurm) => DEFAULT_MASTER_PORT,
            (None, Launcher::Torchrun) => return Err(missing(&["MASTER_PORT"], port_what)),
        };
        Ok(Self {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            launcher,
        })
    }
}

fn invalid_timeout(setting: &str, value: String, reason: String) -> CollectiveError {
    CollectiveError::InvalidTimeout {
        setting: setting.to_string(),
        value,
        reason,
    }
}

/// Checks that `timeout` (from `setting`) is positive and at most [`MAX_TIMEOUT`].
///
/// # Errors
/// [`CollectiveError::InvalidTimeout`] naming `setting`.
pub(crate) fn check_timeout(setting: &str, timeout: Duration) -> Result<Duration> {
    if timeout.is_zero() {
        return Err(invalid_timeout(
            setting,
            format!("{timeout:?}"),
            "it must be positive".into(),
        ));
    }
    if timeout > MAX_TIMEOUT {
        return Err(invalid_timeout(
            setting,
            format!("{timeout:?}"),
            format!(
                "it is longer than the {} s (a year) a timeout may be; give at most that",
                MAX_TIMEOUT.as_secs()
            ),
        ));
    }
    Ok(timeout)
}

/// The instant `timeout` (from `setting`) after now.
///
/// # Errors
/// [`CollectiveError::InvalidTimeout`] when the deadline cannot be represented.
pub(crate) fn deadline_after(setting: &str, timeout: Duration) -> Result<Instant> {
    Instant::now().checked_add(timeout).ok_or_else(|| {
        invalid_timeout(
            setting,
            format!("{timeout:?}"),
            format!(
                "a deadline that far away cannot be represented; give at most {} s",
                MAX_TIMEOUT.as_secs()
            ),
        )
    })
}

/// Parses `raw`, the value of the variable `setting`, as a number of seconds: positive,
/// finite and at most [`MAX_TIMEOUT`] (`inf`, `NaN`, `-1`, `1e30` and `0` are refused).
///
/// # Errors
/// [`CollectiveError::InvalidTimeout`] naming `setting` and what to give instead.
pub(crate) fn parse_timeout_secs(setting: &str, raw: &str) -> Result<Duration> {
    let what = "set it to a positive number of seconds, such as 300";
    let secs: f64 = raw.trim().parse().map_err(|_| {
        invalid_timeout(setting, format!("{raw:?}"), format!("not a number; {what}"))
    })?;
    if !secs.is_finite() || secs <= 0.0 {
        return Err(invalid_timeout(
            setting,
            format!("{raw:?}"),
            format!("it must be finite and positive; {what}"),
        ));
    }
    if secs > MAX_TIMEOUT.as_secs_f64() {
        return Err(invalid_timeout(
            setting,
            format!("{raw:?}"),
            format!(
                "it is longer than the {} s (a year) a timeout may be; give at most that",
                MAX_TIMEOUT.as_secs()
            ),
        ));
    }
    let timeout = Duration::try_from_secs_f64(secs)
        .map_err(|e| invalid_timeout(setting, format!("{raw:?}"), format!("{e}; {what}")))?;
    // Below a nanosecond rounds to zero.
    check_timeout(setting, timeout)
        .map_err(|_| invalid_timeout(setting, format!("{raw:?}"), format!("too small; {what}")))
}

/// The variable `setting` as a timeout, `None` when it is not set.
///
/// # Errors
/// [`CollectiveError::InvalidTimeout`] when it is set to something [`parse_timeout_secs`]
/// refuses (or to bytes that are not UTF-8).
pub(crate) fn timeout_from_env(setting: &str) -> Result<Option<Duration>> {
    match std::env::var(setting) {
        Ok(v) => parse_timeout_secs(setting, &v).map(Some),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(v)) => Err(invalid_timeout(
            setting,
            format!("{v:?}"),
            "not valid UTF-8; set it to a positive number of seconds".into(),
        )),
    }
}

/// `BURN_PARALLEL_RENDEZVOUS_TIMEOUT_SECS`, or [`DEFAULT_RENDEZVOUS_TIMEOUT`].
pub(crate) fn rendezvous_timeout_from_env() -> Result<Duration> {
    Ok(timeout_from_env("BURN_PARALLEL_RENDEZVOUS_TIMEOUT_SECS")?
        .unwrap_or(DEFAULT_RENDEZVOUS_TIMEOUT))
}

/// The variable that turns on rejoining ([`super::TcpConfig::rejoin`]).
pub const FAULT_TOLERANT_ENV: &str = "BURN_PARALLEL_FAULT_TOLERANT";

/// Reads a [`FAULT_TOLERANT_ENV`] value: `1` or `true` turn rejoining on; `0`, `false`, empty
/// or unset (`None`) leave it off (case and surrounding blanks do not matter).
///
/// # Errors
/// [`CollectiveError::Rendezvous`] naming the variable for any other value, as for the other
/// garbled launch variables.
pub(crate) fn parse_fault_tolerant(raw: Option<&str>) -> Result<bool> {
    let Some(raw) = raw else {
        return Ok(false);
    };
    match raw.trim().to_ascii_lowercase().as_str() {
        "1" | "true" => Ok(true),
        "" | "0" | "false" => Ok(false),
        _ => Err(CollectiveError::Rendezvous(format!(
            "{FAULT_TOLERANT_ENV}={raw:?} is not a valid value: set {FAULT_TOLERANT_ENV} to 1 \
             or true (a restarted rank may rejoin the running job) or to 0, false or nothing"
        ))),
    }
}

/// [`FAULT_TOLERANT_ENV`] from the environment (see [`parse_fault_tolerant`]).
pub(crate) fn fault_tolerant_from_env() -> Result<bool> {
    match std::env::var(FAULT_TOLERANT_ENV) {
        Ok(v) => parse_fault_tolerant(Some(&v)),
        Err(std::env::VarError::NotPresent) => Ok(false),
        Err(std::env::VarError::NotUnicode(v)) => Err(CollectiveError::Rendezvous(format!(
            "{FAULT_TOLERANT_ENV}={v:?} is not valid UTF-8: set it to 1, true, 0 or false"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fault_tolerant_values() {
        for (raw, on) in [
            (None, false),
            (Some(""), false),
            (Some("0"), false),
            (Some("false"), false),
            (Some("1"), true),
            (Some(" TRUE "), true),
        ] {
            assert_eq!(parse_fault_tolerant(raw).unwrap(), on, "{raw:?}");
        }
        for raw in ["yes", "2", "on"] {
            match parse_fault_tolerant(Some(raw)) {
                Err(CollectiveError::Rendezvous(m)) => assert!(m.contains(FAULT_TOLERANT_ENV)),
                other => panic!("{raw:?} gave {other:?}"),
            }
        }
    }

    #[test]
    fn first_hosts() {
        assert_eq!(first_host("node[03-05,9],gpu1").as_deref(), Some("node03"));
        assert_eq!(first_host("gpu1,gpu2").as_deref(), Some("gpu1"));
        assert_eq!(first_host("a[2,4]-b[07-09]").as_deref(), Some("a2-b07"));
        assert_eq!(first_host("solo").as_deref(), Some("solo"));
        assert_eq!(first_host(""), None);
    }

    #[test]
    fn unusable_timeouts_are_typed_errors() {
        let setting = "BURN_PARALLEL_TIMEOUT_SECS";
        for raw in ["inf", "-inf", "NaN", "-1", "0", "1e30", "1e-12", "ten", ""] {
            match parse_timeout_secs(setting, raw) {
                Err(CollectiveError::InvalidTimeout { setting: s, .. }) => assert_eq!(s, setting),
                other => panic!("{raw:?} gave {other:?}"),
            }
        }
        assert_eq!(
            parse_timeout_secs(setting, " 2.5 ").unwrap(),
            Duration::from_millis(2500)
        );
        assert_eq!(
            parse_timeout_secs(setting, "31536000").unwrap(),
            MAX_TIMEOUT
        );
        assert!(check_timeout("t", Duration::MAX).is_err());
        assert!(check_timeout("t", Duration::ZERO).is_err());
        assert!(matches!(
            deadline_after("t", Duration::MAX),
            Err(CollectiveError::InvalidTimeout { .. })
        ));
        assert!(deadline_after("t", MAX_TIMEOUT).is_ok());
    }
}
