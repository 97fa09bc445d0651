//! Timelines of pipeline steps, measured ([`crate::runtime::StepReport`]) or simulated
//! ([`crate::simulate::Report`]), as one type: [`Timeline`], one [`Track`] of [`Span`]s per
//! rank. A timeline gives its bubble fraction the way the simulator defines it, and writes a
//! Chrome/Perfetto trace (open it in `chrome://tracing` or <https://ui.perfetto.dev>).
//!
//! A measured timeline is built from the step reports of every rank
//! ([`Timeline::from_steps`]): each report carries the wall-clock time its step began, so the
//! tracks are placed on one time axis (ranks on one machine share the clock; across machines
//! the axis is as good as their clock synchronisation).
//!
//! ```
//! use burn_pipeline::generators::one_f_one_b;
//! use burn_pipeline::simulate::{simulate, Costs};
//! use burn_pipeline::trace::Timeline;
//!
//! let report = simulate(&one_f_one_b(2, 4).unwrap(), &Costs::unit()).unwrap();
//! let timeline = Timeline::from_simulated(&report);
//! assert!((timeline.bubble_fraction() - report.bubble_fraction).abs() < 1e-12);
//! let json = timeline.chrome_trace(1000.0); // one cost unit = 1 ms
//! assert!(json.contains(r#""name":"0F0""#));
//! ```

use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use crate::schedule::Action;

/// One action placed in time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Span {
    /// The action.
    pub action: Action,
    /// Start time (seconds since the step began for a measured step; cost units for a
    /// simulated one).
    pub start: f64,
    /// End time. A simulated send takes no time; a receive ends when its message arrived.
    pub end: f64,
}

/// One rank's actions.
#[derive(Clone, Debug, PartialEq)]
pub struct Track {
    /// The track's label (`"rank 2"`, `"pp 1 / dp 0"`).
    pub name: String,
    /// The actions in program order.
    pub spans: Vec<Span>,
}

/// The tracks of one step on one time axis.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Timeline {
    /// One track per rank.
    pub tracks: Vec<Track>,
}

/// A rank's measured step in a form every transport can carry
/// (`ProcessGroup::all_gather_object`), for [`Timeline::from_steps`] on another rank.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepTrack {
    /// The track's label.
    pub name: String,
    /// When the step began, seconds since the Unix epoch.
    pub began: f64,
    spans: Vec<(String, f64, f64)>,
}

impl StepTrack {
    /// A step under the label `name` that began at `began`, its `spans` in seconds since then.
    /// (From a step report: `StepTrack::new`, defined with the report in [`crate::runtime`],
    /// which sits above this module.)
    pub(crate) fn from_spans(name: String, began: SystemTime, spans: &[Span]) -> Self {
        let began = began
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        Self {
            name,
            began,
            spans: spans
                .iter()
                .map(|s| (s.action.to_string(), s.start, s.end))
                .collect(),
        }
    }
}

impl Timeline {
    /// The measured timeline of one step from every rank's [`StepTrack`], on the time axis of
    /// the earliest-starting rank.
    ///
    /// # Errors
    /// A message naming the track whose action text does not parse (a corrupt track).
    pub fn from_steps(steps: &[StepTrack]) -> Result<Self, String> {
        let origin = steps.iter().map(|s| s.began).fold(f64::INFINITY, f64::min);
        let tracks = steps
            .iter()
            .map(|step| {
                let shift = step.began - origin;
                let spans = step
                    .spans
                    .iter()
                    .map(|(a, start, end)| {
                        let action: Action = a
                            .parse()
                            .map_err(|e| format!("track {}: action {a:?}: {e}", step.name))?;
                        Ok(Span {
                            action,
                            start: start + shift,
                            end: end + shift,
                        })
                    })
                    .collect::<Result<Vec<_>, String>>()?;
                Ok(Track {
                    name: step.name.clone(),
                    spans,
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok(Self { tracks })
    }

    /// From the first start to the last end over all tracks.
    pub fn makespan(&self) -> f64 {
        let spans = || self.tracks.iter().flat_map(|t| &t.spans);
        let first = spans().map(|s| s.start).fold(f64::INFINITY, f64::min);
        let last = spans().map(|s| s.end).fold(f64::NEG_INFINITY, f64::max);
        if last > first { last - first } else { 0.0 }
    }

    /// Computation time (`F`, `B`, `I`, `W`, `REDUCE`) of each track.
    pub fn busy(&self) -> Vec<f64> {
        self.tracks
            .iter()
            .map(|t| {
                t.spans
                    .iter()
                    .filter(|s| s.action.is_compute())
                    .map(|s| s.end - s.start)
                    .sum()
            })
            .collect()
    }

    /// The idle share of all rank time, `1 - Σ busy / (tracks × makespan)`: the definition
    /// of [`crate::simulate::Report::bubble_fraction`], so that a measured step and its
    /// prediction compare directly. Time spent sending or waiting to receive is idle.
    pub fn bubble_fraction(&self) -> f64 {
        let makespan = self.makespan();
        if makespan <= 0.0 || self.tracks.is_empty() {
            return 0.0;
        }
        1.0 - self.busy().iter().sum::<f64>() / (self.tracks.len() as f64 * makespan)
    }

    /// The timeline as a Chrome/Perfetto trace (JSON): one track per rank, a complete event
    /// per computation and per send or receive that took time (category `comm`), an instant
    /// event for one that took none. `us_per_unit`: microseconds per time unit (`1e6` for a
    /// measured timeline in seconds).
    pub fn chrome_trace(&self, us_per_unit: f64) -> String {
        let origin = self
            .tracks
            .iter()
            .flat_map(|t| &t.spans)
            .map(|s| s.start)
            .fold(f64::INFINITY, f64::min);
        let origin = if origin.is_finite() { origin } else { 0.0 };
        let mut events: Vec<String> = Vec::new();
        for (tid, track) in self.tracks.iter().enumerate() {
            let label = serde_json::to_string(&track.name).unwrap_or_else(|_| "\"?\"".into());
            events.push(format!(
                r#"{{"name":"thread_name","ph":"M","pid":0,"tid":{tid},"args":{{"name":{label}}}}}"#
            ));
            for span in &track.spans {
                let name = span.action.to_string();
                let cat = if span.action.is_compute() {
                    format!("{:?}", span.action.kind())
                } else {
                    "comm".to_string()
                };
                let ts = (span.start - origin) * us_per_unit;
                let dur = (span.end - span.start) * us_per_unit;
                if span.action.is_compute() || dur > 0.0 {
                    events.push(format!(
                        r#"{{"name":"{name}","cat":"{cat}","ph":"X","pid":0,"tid":{tid},"ts":{ts:.3},"dur":{dur:.3}}}"#
                    ));
                } else {
                    events.push(format!(
                        r#"{{"name":"{name}","cat":"{cat}","ph":"i","s":"t","pid":0,"tid":{tid},"ts":{ts:.3}}}"#
                    ));
                }
            }
        }
        format!("{{\"traceEvents\":[\n{}\n]}}\n", events.join(",\n"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generators::generate;
    use crate::simulate::{Costs, simulate};

    fn span(action: &str, start: f64, end: f64) -> Span {
        Span {
            action: action.parse().unwrap(),
            start,
            end,
        }
    }

    #[test]
    fn measured_tracks_are_aligned_on_their_start_times() {
        let a = StepTrack {
            name: "rank 0".into(),
            began: 100.0,
            spans: vec![
                ("0F0".into(), 0.0, 1.0),
                ("SEND_F(0->1,m0)".into(), 1.0, 1.0),
            ],
        };
        let b = StepTrack {
            name: "rank 1".into(),
            began: 100.5,
            spans: vec![
                ("RECV_F(0->1,m0)".into(), 0.0, 0.5),
                ("1F0".into(), 0.5, 1.5),
            ],
        };
        let t = Timeline::from_steps(&[a, b]).unwrap();
        assert_eq!(t.tracks[1].spans[1], span("1F0", 1.0, 2.0));
        assert!((t.makespan() - 2.0).abs() < 1e-12);
        // busy 1 + 1 over 2 tracks x 2: half idle (the receive counts as idle).
        assert!((t.bubble_fraction() - 0.5).abs() < 1e-12);
        let json = t.chrome_trace(1e6);
        assert!(json.contains(r#""name":"RECV_F(0->1,m0)","cat":"comm","ph":"X""#));
        assert!(json.contains(r#""name":"SEND_F(0->1,m0)","cat":"comm","ph":"i""#));
        let parsed: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(parsed["traceEvents"].as_array().unwrap().len(), 6);
    }

    #[test]
    fn a_corrupt_track_names_itself() {
        let bad = StepTrack {
            name: "rank 3".into(),
            began: 0.0,
            spans: vec![("0X0".into(), 0.0, 1.0)],
        };
        let err = Timeline::from_steps(&[bad]).unwrap_err();
        assert!(err.contains("rank 3") && err.contains("0X0"), "{err}");
    }

    #[test]
    fn a_simulated_timeline_has_the_simulators_bubble() {
        for kind in ["gpipe", "1f1b", "zb-h1", "zbv"] {
            let schedule = generate(kind.parse().unwrap(), 4, 8, None).unwrap();
            let report = simulate(&schedule, &Costs::unit()).unwrap();
            let timeline = Timeline::from_simulated(&report);
            assert!(
                (timeline.bubble_fraction() - report.bubble_fraction).abs() < 1e-12,
                "{kind}"
            );
        }
    }
}
