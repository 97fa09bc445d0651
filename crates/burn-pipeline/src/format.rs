//! Reading and writing schedules as CSV or TOML, and listing rank programs side by side.
//!
//! # Action grammar
//!
//! ```text
//! action   = compute | transfer | reduce
//! compute  = stage kind microbatch            kind = "F" | "B" | "I" | "W"
//! transfer = op "(" stage "->" stage ",m" microbatch ")"
//!            op = "SEND_F" | "RECV_F" | "SEND_B" | "RECV_B"
//! reduce   = "REDUCE(" stage ")"
//! stage, microbatch = decimal integer
//! ```
//!
//! `0F3` is the forward of micro-batch 3 through stage 0; `1B2` a full backward, `1I2` its
//! input-gradient half and `1W2` its weight-gradient half. In a transfer the arrow follows
//! the data: `SEND_F(1->2,m3)` runs on stage 1's rank and `RECV_F(1->2,m3)` on stage 2's;
//! gradients go down, `SEND_B(2->1,m3)` / `RECV_B(2->1,m3)`. A send and its receive read the
//! same apart from the operation, which makes matching them by eye easy.
//!
//! # CSV
//!
//! One row per rank, in rank order; one action per field; empty fields are ignored (so rows
//! may be padded); a line starting with `#` is a comment. Transfer tokens contain a comma, so
//! they are written quoted (`"SEND_F(1->2,m3)"`, standard CSV quoting); unquoted transfer
//! tokens are accepted too (commas inside parentheses do not split fields). The stage
//! placement and the micro-batch count are inferred: a stage lives on the rank whose row holds
//! its first computation, and the micro-batch count is the largest index plus one.
//!
//! # TOML
//!
//! ```toml
//! kind = "1f1b"             # optional: gpipe, 1f1b, interleaved, zb-h1, zbv, custom
//! microbatches = 2
//! stage_to_rank = [0, 1]    # rank of each stage
//!
//! [[rank]]                  # rank 0
//! actions = ["0F0", "SEND_F(0->1,m0)", "0F1", "SEND_F(0->1,m1)", "RECV_B(1->0,m0)", "0B0",
//!            "RECV_B(1->0,m1)", "0B1", "REDUCE(0)"]
//!
//! [[rank]]                  # rank 1
//! actions = ["RECV_F(0->1,m0)", "1F0", "1B0", "SEND_B(1->0,m0)", "RECV_F(0->1,m1)", "1F1",
//!            "1B1", "SEND_B(1->0,m1)", "REDUCE(1)"]
//! ```
//!
//! [`from_csv`], [`from_toml`] and [`load`] validate what they read (eager sends); the
//! `parse_*` functions only parse, so that a broken schedule can still be inspected with
//! [`render_programs`].

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::schedule::{Action, ActionParseError, Placement, Schedule, ScheduleError, ScheduleKind};
use crate::validate::ValidationError;

/// Why a schedule file could not be read, written or accepted.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    /// Reading or writing the file failed.
    #[error("cannot {op} schedule file {}: {source}", path.display())]
    Io {
        /// "read" or "write".
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file name ends neither in `.csv` nor in `.toml`.
    #[error("schedule file {} must end in .csv or .toml", path.display())]
    UnknownExtension {
        /// The file.
        path: PathBuf,
    },
    /// A CSV line is malformed (an unterminated quote).
    #[error("CSV line {line}: {reason}")]
    Csv {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        reason: String,
    },
    /// An action token does not follow the grammar.
    #[error("{location}: {source}")]
    Action {
        /// Where: `CSV line L, field F` or `TOML rank R, action A`.
        location: String,
        /// The token error.
        source: ActionParseError,
    },
    /// The TOML document does not have the expected shape.
    #[error("TOML schedule: {0}")]
    Toml(String),
    /// The file holds no rank.
    #[error("the schedule file holds no rank program")]
    Empty,
    /// A stage is mentioned but never computed, so its rank cannot be inferred.
    #[error(
        "stage {stage} is mentioned but no rank computes it, so its rank is unknown; add its \
         actions to its rank's row"
    )]
    UnplacedStage {
        /// The stage.
        stage: usize,
    },
    /// The parsed schedule is inconsistent (placement, sizes).
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    /// The schedule parses but is unsafe to run.
    #[error("the schedule is invalid: {0}")]
    Invalid(#[from] ValidationError),
}

/// Splits one CSV line into fields: standard double-quote quoting, and commas inside
/// parentheses of an unquoted field do not split it.
fn split_csv_line(line: &str, number: usize) -> Result<Vec<String>, FormatError> {
    let mut fields = Vec::new();
    let mut field = String::new();
    let mut chars = line.chars().peekable();
    let (mut quoted, mut depth) = (false, 0usize);
    while let Some(c) = chars.next() {
        match c {
            '"' if quoted => {
                if chars.peek() == Some(&'"') {
                    field.push('"');
                    chars.next();
                } else {
                    quoted = false;
                }
            }
            '"' if field.trim().is_empty() => {
                field.clear();
                quoted = true;
            }
            '(' if !quoted => {
                depth += 1;
                field.push(c);
            }
            ')' if !quoted => {
                depth = depth.saturating_sub(1);
                field.push(c);
            }
            ',' if !quoted && depth == 0 => fields.push(std::mem::take(&mut field)),
            _ => field.push(c),
        }
    }
    if quoted {
        return Err(FormatError::Csv {
            line: number,
            reason: "unterminated quoted field".into(),
        });
    }
    fields.push(field);
    Ok(fields)
}

/// Builds a schedule from parsed rank programs, inferring placement and micro-batch count.
fn assemble(kind: ScheduleKind, programs: Vec<Vec<Action>>) -> Result<Schedule, FormatError> {
    if programs.is_empty() {
        return Err(FormatError::Empty);
    }
    let all = programs.iter().flatten();
    let num_stages = all
        .clone()
        .flat_map(|a| std::iter::once(a.stage()).chain(a.peer_stage()))
        .max()
        .map_or(0, |s| s + 1);
    let microbatches = all
        .filter_map(Action::microbatch)
        .max()
        .map_or(1, |m| m + 1);
    let mut stage_to_rank: Vec<Option<usize>> = vec![None; num_stages];
    for (rank, program) in programs.iter().enumerate() {
        for action in program.iter().filter(|a| a.is_compute()) {
            stage_to_rank[action.stage()].get_or_insert(rank);
        }
    }
    let stage_to_rank = stage_to_rank
        .into_iter()
        .enumerate()
        .map(|(stage, r)| r.ok_or(FormatError::UnplacedStage { stage }))
        .collect::<Result<Vec<_>, _>>()?;
    let placement = Placement::custom(programs.len(), stage_to_rank)?;
    Ok(Schedule::new(kind, placement, microbatches, programs)?)
}

/// Parses a CSV schedule without validating it (see the module docs for the format).
///
/// # Errors
/// [`FormatError::Csv`], [`FormatError::Action`] (with line and field),
/// [`FormatError::Empty`], [`FormatError::UnplacedStage`] or [`FormatError::Schedule`].
pub fn parse_csv(text: &str) -> Result<Schedule, FormatError> {
    let mut programs = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let mut program = Vec::new();
        for (f, field) in split_csv_line(line, i + 1)?.iter().enumerate() {
            if field.trim().is_empty() {
                continue;
            }
            program.push(field.parse().map_err(|source| FormatError::Action {
                location: format!("CSV line {}, field {}", i + 1, f + 1),
                source,
            })?);
        }
        programs.push(program);
    }
    assemble(ScheduleKind::Custom, programs)
}

/// Parses and validates a CSV schedule.
///
/// # Arguments
/// * `text` - the CSV document.
///
/// # Returns
/// The schedule (kind [`ScheduleKind::Custom`]), proven valid.
///
/// # Errors
/// The [`parse_csv`] errors, or [`FormatError::Invalid`].
///
/// # Example
/// ```
/// let csv = "0F0,\"SEND_F(0->1,m0)\",RECV_B(1->0,m0),0B0,REDUCE(0)\n\
///            RECV_F(0->1,m0),1F0,1B0,SEND_B(1->0,m0),REDUCE(1)\n";
/// let schedule = burn_pipeline::format::from_csv(csv).unwrap();
/// assert_eq!(schedule.num_ranks(), 2);
/// assert_eq!(burn_pipeline::format::to_csv(&schedule).lines().count(), 3);
/// ```
pub fn from_csv(text: &str) -> Result<Schedule, FormatError> {
    let schedule = parse_csv(text)?;
    schedule.validate()?;
    Ok(schedule)
}

/// Writes a schedule as CSV: a comment line with kind, ranks, stages and micro-batches, then
/// one row per rank; transfer tokens are quoted.
pub fn to_csv(schedule: &Schedule) -> String {
    let mut out = format!(
        "# burn-pipeline schedule: kind {}, {} ranks, {} stages (stage -> rank {:?}), {} micro-batches\n",
        schedule.kind(),
        schedule.num_ranks(),
        schedule.num_stages(),
        schedule.placement().stage_to_rank(),
        schedule.num_microbatches()
    );
    for program in schedule.programs() {
        let fields: Vec<String> = program
            .iter()
            .map(|a| {
                let t = a.to_string();
                if t.contains(',') {
                    format!("\"{t}\"")
                } else {
                    t
                }
            })
            .collect();
        out.push_str(&fields.join(","));
        out.push('\n');
    }
    out
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct TomlSchedule {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    kind: Option<String>,
    microbatches: usize,
    stage_to_rank: Vec<usize>,
    rank: Vec<TomlRank>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct TomlRank {
    actions: Vec<String>,
}

/// Parses a TOML schedule without validating it (see the module docs for the layout).
///
/// # Errors
/// [`FormatError::Toml`] (shape, unknown keys, unknown kind), [`FormatError::Action`]
/// (with rank and position), [`FormatError::Empty`] or [`FormatError::Schedule`] (for
/// example a `stage_to_rank` naming a rank without a `[[rank]]` table).
pub fn parse_toml(text: &str) -> Result<Schedule, FormatError> {
    let doc: TomlSchedule = toml::from_str(text).map_err(|e| FormatError::Toml(e.to_string()))?;
    if doc.rank.is_empty() {
        return Err(FormatError::Empty);
    }
    let kind = match &doc.kind {
        Some(name) => name
            .parse()
            .map_err(|e: ScheduleError| FormatError::Toml(e.to_string()))?,
        None => ScheduleKind::Custom,
    };
    let programs = doc
        .rank
        .iter()
        .enumerate()
        .map(|(r, rank)| {
            rank.actions
                .iter()
                .enumerate()
                .map(|(i, token)| {
                    token.parse().map_err(|source| FormatError::Action {
                        location: format!("TOML rank {r}, action {i}"),
                        source,
                    })
                })
                .collect::<Result<Vec<Action>, _>>()
        })
        .collect::<Result<Vec<_>, _>>()?;
    let placement = Placement::custom(doc.rank.len(), doc.stage_to_rank)?;
    Ok(Schedule::new(kind, placement, doc.microbatches, programs)?)
}

/// Parses and validates a TOML schedule.
///
/// # Arguments
/// * `text` - the TOML document.
///
/// # Returns
/// The schedule, proven valid.
///
/// # Errors
/// The [`parse_toml`] errors, or [`FormatError::Invalid`].
///
/// # Example
/// ```
/// use burn_pipeline::{format, generators::zbv};
/// let schedule = zbv(2, 4).unwrap();
/// let text = format::to_toml(&schedule);
/// assert_eq!(format::from_toml(&text).unwrap(), schedule);
/// ```
pub fn from_toml(text: &str) -> Result<Schedule, FormatError> {
    let schedule = parse_toml(text)?;
    schedule.validate()?;
    Ok(schedule)
}

/// Writes a schedule as TOML (one `[[rank]]` table per rank, in rank order).
pub fn to_toml(schedule: &Schedule) -> String {
    let doc = TomlSchedule {
        kind: Some(schedule.kind().name().to_string()),
        microbatches: schedule.num_microbatches(),
        stage_to_rank: schedule.placement().stage_to_rank().to_vec(),
        rank: schedule
            .programs()
            .iter()
            .map(|p| TomlRank {
                actions: p.iter().map(ToString::to_string).collect(),
            })
            .collect(),
    };
    // Serialising plain strings, integers and arrays cannot fail.
    toml::to_string_pretty(&doc).unwrap_or_default()
}

fn extension(path: &Path) -> Result<&'static str, FormatError> {
    match path.extension().and_then(|e| e.to_str()) {
        Some(e) if e.eq_ignore_ascii_case("csv") => Ok("csv"),
        Some(e) if e.eq_ignore_ascii_case("toml") => Ok("toml"),
        _ => Err(FormatError::UnknownExtension {
            path: path.to_path_buf(),
        }),
    }
}

/// Reads and validates a schedule file, CSV or TOML by extension.
///
/// # Errors
/// [`FormatError::UnknownExtension`], [`FormatError::Io`], or the parse and validation
/// errors of [`from_csv`] / [`from_toml`].
pub fn load(path: impl AsRef<Path>) -> Result<Schedule, FormatError> {
    let path = path.as_ref();
    let ext = extension(path)?;
    let text = std::fs::read_to_string(path).map_err(|source| FormatError::Io {
        op: "read",
        path: path.to_path_buf(),
        source,
    })?;
    match ext {
        "csv" => from_csv(&text),
        _ => from_toml(&text),
    }
}

/// Writes a schedule file, CSV or TOML by extension.
///
/// # Errors
/// [`FormatError::UnknownExtension`] or [`FormatError::Io`].
pub fn save(schedule: &Schedule, path: impl AsRef<Path>) -> Result<(), FormatError> {
    let path = path.as_ref();
    let text = match extension(path)? {
        "csv" => to_csv(schedule),
        _ => to_toml(schedule),
    };
    std::fs::write(path, text).map_err(|source| FormatError::Io {
        op: "write",
        path: path.to_path_buf(),
        source,
    })
}

/// Lists the rank programs side by side, one line per program step, one column per rank.
/// Works on invalid schedules too: pass the location of a validation error
/// ([`ValidationError::location`]) as `mark` to flag that action with `<<`.
///
/// # Arguments
/// * `schedule` - the schedule.
/// * `mark` - an optional `(rank, index)` to flag.
///
/// # Returns
/// The listing as text.
pub fn render_programs(schedule: &Schedule, mark: Option<(usize, usize)>) -> String {
    let programs = schedule.programs();
    let steps = programs.iter().map(Vec::len).max().unwrap_or(0);
    let cell = |r: usize, i: usize| -> String {
        let text = programs[r]
            .get(i)
            .map(ToString::to_string)
            .unwrap_or_default();
        if mark == Some((r, i)) {
            format!("{text} <<")
        } else {
            text
        }
    };
    let width = (0..programs.len())
        .flat_map(|r| (0..steps).map(move |i| (r, i)))
        .map(|(r, i)| cell(r, i).len())
        .chain([7])
        .max()
        .unwrap_or(7);
    let mut out = format!("{:>5} ", "step");
    for r in 0..programs.len() {
        let _ = write!(out, "| {:<width$} ", format!("rank {r}"));
    }
    out.truncate(out.trim_end().len());
    out.push('\n');
    for i in 0..steps {
        let _ = write!(out, "{i:>5} ");
        for r in 0..programs.len() {
            let _ = write!(out, "| {:<width$} ", cell(r, i));
        }
        out.truncate(out.trim_end().len());
        out.push('\n');
    }
    out
}
