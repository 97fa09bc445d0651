//! The chart of a run's [`Metrics`] (the `plot` feature): one SVG, its panels stacked, the step
//! on every x axis:
//!
//! 1. the loss: the training loss of every step and each evaluation whose name has `loss` in
//!    it (`val_loss`), its points marked;
//! 2. the throughput (tokens/s, images/s: the run's unit);
//! 3. one panel for each other evaluation (`test_accuracy`, ...).
//!
//! Drawn with `plotters`' SVG backend without its font features: the text is SVG `<text>` in
//! the viewer's sans-serif font, so nothing beyond Rust is needed to build or draw it.
//! [`draw_file`] draws a metrics file written earlier (`burnplot metrics.jsonl -o chart.svg`, the
//! binary of this crate's `cli` feature); a training binary's `--plot` draws at the end of the
//! run ([`crate::cli::MetricsArgs`]).
//!
//! ```
//! use burn_parallel_train::metrics::{Metrics, Record, StepRecord};
//! use burn_parallel_train::plot;
//!
//! let mut metrics = Metrics::new();
//! for step in 0..10 {
//!     let loss = 4.0 / (1.0 + step as f64);
//!     metrics.push(Record::Step(StepRecord::new(step, loss, 1e-3, 5000.0, step as f64)));
//! }
//! metrics.push(Record::eval(9, "val_loss", 0.5));
//! let svg = plot::render(&metrics, "a run")?;
//! assert!(svg.starts_with("<svg") && svg.contains("tokens/s") && svg.contains("val_loss"));
//! # Ok::<(), burn_parallel_train::metrics::MetricsError>(())
//! ```

use std::ops::Range;
use std::path::Path;

use plotters::prelude::*;

use crate::metrics::{Metrics, MetricsError};

/// Width of the chart, and height of one panel, in pixels.
const WIDTH: u32 = 960;
const PANEL_HEIGHT: u32 = 320;
const TITLE_HEIGHT: u32 = 40;

/// The colours of the series: training loss, throughput, then the evaluations.
const COLOURS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
];

/// One line of a panel.
struct Series {
    label: String,
    points: Vec<(f64, f64)>,
    colour: RGBColor,
    /// Mark each point (evaluations: few points, maybe one).
    marked: bool,
}

/// One panel: its caption, its y axis's title and its lines.
struct Panel {
    caption: String,
    y_desc: String,
    series: Vec<Series>,
    /// The y axis starts at 0 (throughput).
    from_zero: bool,
}

/// The SVG text of `metrics`' chart, titled `title`.
///
/// # Errors
/// [`MetricsError::Plot`] for metrics without a step record.
pub fn render(metrics: &Metrics, title: &str) -> Result<String, MetricsError> {
    let failed = |reason: String| MetricsError::Plot { path: None, reason };
    if metrics.steps.is_empty() {
        return Err(failed("no step recorded: nothing to draw".into()));
    }
    let panels = panels(metrics);
    let height = TITLE_HEIGHT + PANEL_HEIGHT * panels.len() as u32;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, height)).into_drawing_area();
        draw_panels(&root, &panels, title, x_range(metrics)).map_err(failed)?;
    }
    Ok(svg)
}

/// Draws `metrics`' chart, titled `title`, into the SVG file `out`.
///
/// # Errors
/// [`MetricsError::Plot`] for metrics without a step record, [`MetricsError::Io`] when `out`
/// cannot be written.
pub fn draw(metrics: &Metrics, title: &str, out: &Path) -> Result<(), MetricsError> {
    let svg = render(metrics, title).map_err(|e| match e {
        MetricsError::Plot { reason, .. } => MetricsError::Plot {
            path: Some(out.to_path_buf()),
            reason,
        },
        other => other,
    })?;
    std::fs::write(out, svg).map_err(|source| MetricsError::Io {
        path: out.to_path_buf(),
        source,
    })
}

/// Draws the chart of the metrics file `input` into the SVG file `output`, titled with
/// `input`'s file name.
///
/// # Errors
/// [`Metrics::read`]'s and [`draw`]'s.
pub fn draw_file(input: &Path, output: &Path) -> Result<(), MetricsError> {
    let metrics = Metrics::read(input)?;
    let name = input.file_name().unwrap_or(input.as_os_str());
    draw(&metrics, &name.to_string_lossy(), output)
}

/// The loss panel, the throughput panel, one panel per other evaluation.
fn panels(metrics: &Metrics) -> Vec<Panel> {
    let steps = &metrics.steps;
    let curve = |value: &dyn Fn(&crate::metrics::StepRecord) -> f64| {
        steps.iter().map(|s| (s.step as f64, value(s))).collect()
    };
    let evals = metrics.eval_names();
    let eval = |(i, name): (usize, &&str)| Series {
        label: name.to_string(),
        points: metrics
            .eval_series(name)
            .into_iter()
            .map(|(step, v)| (step as f64, v))
            .collect(),
        colour: COLOURS[2 + i % (COLOURS.len() - 2)],
        marked: true,
    };
    let (losses, others): (Vec<_>, Vec<_>) = evals
        .iter()
        .enumerate()
        .partition(|(_, name)| name.contains("loss"));
    let mut loss = vec![Series {
        label: "train loss".into(),
        points: curve(&|s| s.loss),
        colour: COLOURS[0],
        marked: steps.len() == 1,
    }];
    loss.extend(losses.into_iter().map(eval));
    let unit = match metrics.unit.as_str() {
        "tok" => "tokens",
        "img" => "images",
        other => other,
    };
    let mut panels = vec![
        Panel {
            caption: "loss".into(),
            y_desc: "loss".into(),
            series: loss,
            from_zero: false,
        },
        Panel {
            caption: "throughput".into(),
            y_desc: format!("{unit}/s"),
            series: vec![Series {
                label: format!("{unit}/s"),
                points: curve(&|s| s.throughput),
                colour: COLOURS[1],
                marked: steps.len() == 1,
            }],
            from_zero: true,
        },
    ];
    for other in others {
        let series = eval(other);
        panels.push(Panel {
            caption: series.label.clone(),
            y_desc: series.label.clone(),
            series: vec![series],
            from_zero: false,
        });
    }
    panels
}

/// The steps drawn: from the first record's to the last's (one step wide at least).
fn x_range(metrics: &Metrics) -> Range<f64> {
    let steps = metrics.steps.iter().map(|s| s.step);
    let all: Vec<usize> = steps.chain(metrics.evals.iter().map(|e| e.step)).collect();
    let (lo, hi) = (all.iter().min(), all.iter().max());
    let (lo, hi) = (*lo.unwrap_or(&0) as f64, *hi.unwrap_or(&0) as f64);
    lo..hi.max(lo + 1.0)
}

/// The y range of `panel`'s finite values, with a margin.
fn y_range(panel: &Panel) -> Range<f64> {
    let values = panel
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1));
    let finite: Vec<f64> = values.filter(|v| v.is_finite()).collect();
    let lo = finite.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = finite.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let (lo, hi) = match (lo.is_finite(), panel.from_zero) {
        (false, _) => (0.0, 1.0),
        (true, true) => (0.0, hi.max(0.0)),
        (true, false) => (lo, hi),
    };
    let pad = match hi - lo {
        span if span > 0.0 => 0.05 * span,
        _ => 0.5 * lo.abs().max(1.0),
    };
    let lo = match panel.from_zero {
        true => 0.0,
        false => lo - pad,
    };
    lo..hi + pad
}

/// The label of `value` on an axis spanning `span`: enough decimals to tell the ticks apart.
fn label(value: f64, span: f64) -> String {
    let decimals = (2.0 - span.log10().floor()).clamp(0.0, 6.0) as usize;
    format!("{value:.decimals$}")
}

/// Draws the title and the panels.
fn draw_panels<DB: DrawingBackend>(
    root: &DrawingArea<DB, plotters::coord::Shift>,
    panels: &[Panel],
    title: &str,
    x: Range<f64>,
) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let body = root
        .titled(title, ("sans-serif", 28))
        .map_err(|e| err(&e))?;
    let areas = body.split_evenly((panels.len(), 1));
    for (panel, area) in panels.iter().zip(&areas) {
        let y = y_range(panel);
        let (x_span, y_span) = (x.end - x.start, y.end - y.start);
        let mut chart = ChartBuilder::on(area)
            .caption(&panel.caption, ("sans-serif", 22))
            .margin(10)
            .x_label_area_size(40)
            .y_label_area_size(80)
            .build_cartesian_2d(x.clone(), y)
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc(panel.y_desc.as_str())
            .label_style(("sans-serif", 15))
            .axis_desc_style(("sans-serif", 17))
            .x_label_formatter(&|v| label(*v, x_span.max(10.0)))
            .y_label_formatter(&|v| label(*v, y_span))
            .light_line_style(RGBColor(235, 235, 235))
            .draw()
            .map_err(|e| err(&e))?;
        for series in &panel.series {
            let colour = series.colour;
            let points = series.points.iter().filter(|p| p.1.is_finite());
            let line = LineSeries::new(points.clone().copied(), colour.stroke_width(2));
            chart
                .draw_series(line)
                .map_err(|e| err(&e))?
                .label(series.label.as_str())
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 20, y)], colour.stroke_width(2))
                });
            if series.marked {
                let marks = points.map(|&p| Circle::new(p, 4, colour.filled()));
                chart.draw_series(marks).map_err(|e| err(&e))?;
            }
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 15))
            .draw()
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{Record, StepRecord};

    fn run(steps: usize) -> Metrics {
        let mut metrics = Metrics::new();
        for step in 0..steps {
            let loss = 5.0 - step as f64 * 0.1;
            let record = StepRecord::new(step, loss, 1e-3, 1000.0 + step as f64, step as f64);
            metrics.push(Record::Step(record));
        }
        metrics
    }

    /// Two panels for a run with a validation loss, a third for an accuracy; axis titles,
    /// legends and one polyline per series.
    #[test]
    fn the_chart_has_a_panel_per_kind_of_figure() {
        let mut metrics = run(20);
        metrics.push(Record::eval(19, "val_loss", 3.5));
        let svg = render(&metrics, "run").unwrap();
        let texts = [
            "train loss",
            "val_loss",
            "tokens/s",
            "step",
            "throughput",
            "run",
        ];
        for text in texts.map(|t| format!("\n{t}\n")) {
            assert!(svg.contains(&text), "{text} missing from the chart");
        }
        let lines = svg.matches("stroke-width=\"2\"").count();
        assert_eq!(lines, 3 + 3, "3 series and their legend marks");
        assert!(
            svg.contains("<circle"),
            "the single validation point is marked"
        );
        metrics.unit = "img".into();
        metrics.push(Record::eval(9, "test_accuracy", 0.8));
        metrics.push(Record::eval(19, "test_accuracy", 0.9));
        let svg = render(&metrics, "run").unwrap();
        assert!(svg.contains("images/s") && svg.contains("test_accuracy"));
    }

    /// A single step, a NaN loss and no steps at all.
    #[test]
    fn degenerate_metrics() {
        let mut metrics = run(1);
        assert!(render(&metrics, "one step").unwrap().contains("<circle"));
        metrics.push(Record::Step(StepRecord::new(1, f64::NAN, 1e-3, 1.0, 1.0)));
        assert!(render(&metrics, "nan").is_ok());
        let err = render(&Metrics::new(), "empty").unwrap_err();
        assert!(err.to_string().contains("nothing to draw"), "{err}");
    }
}
