//! burn-pipeline: pipeline schedules as data.

pub mod format;
pub mod generators;
pub mod schedule;
pub mod simulate;
pub mod validate;

pub use schedule::{
    Action, ActionKind, ActionParseError, Payload, Placement, PlacementStyle, Schedule,
    ScheduleError, ScheduleKind, Transfer,
};
