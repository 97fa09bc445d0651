//! The simulator against the known closed forms, with unit costs F = 1, B = 2, I = W = 1
//! and free communication unless stated.

use burn_pipeline::generators::{gpipe, interleaved_1f1b, one_f_one_b, zb_h1, zbv};
use burn_pipeline::simulate::{Costs, simulate};

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

fn grid() -> impl Iterator<Item = (usize, usize)> {
    (2..=4usize).flat_map(|p| (p..=4 * p).map(move |m| (p, m)))
}

/// GPipe and 1F1B: bubble (p - 1) / (m + p - 1), makespan 3 (m + p - 1).
#[test]
fn gpipe_and_1f1b_bubble() {
    for (p, m) in grid() {
        let theory = (p - 1) as f64 / (m + p - 1) as f64;
        for s in [gpipe(p, m).unwrap(), one_f_one_b(p, m).unwrap()] {
            let r = simulate(&s, &Costs::unit()).unwrap();
            assert!(
                close(r.makespan, 3.0 * (m + p - 1) as f64),
                "{} p={p} m={m}",
                s.kind()
            );
            assert!(
                close(r.bubble_fraction, theory),
                "{} p={p} m={m}: {} vs {theory}",
                s.kind(),
                r.bubble_fraction
            );
        }
    }
}

/// Interleaved 1F1B with v stages per rank (each stage costing F = 1, B = 2): bubble
/// (p - 1) / (v m + p - 1), i.e. the bubble time 3 (p - 1) of 1F1B against v times the
/// work; makespan 3 (v m + p - 1). Checked for v = 1..=4 where m % p == 0.
#[test]
fn interleaved_bubble_is_divided_by_v() {
    for (p, m) in grid().filter(|(p, m)| m % p == 0) {
        for v in 1..=4 {
            let r = simulate(&interleaved_1f1b(p, m, v).unwrap(), &Costs::unit()).unwrap();
            let theory = (p - 1) as f64 / (v * m + p - 1) as f64;
            assert!(
                close(r.makespan, 3.0 * (v * m + p - 1) as f64),
                "p={p} m={m} v={v}"
            );
            assert!(close(r.bubble_fraction, theory), "p={p} m={m} v={v}");
        }
    }
}

/// ZB-H1 with F = I = W = 1: every rank idles exactly p - 1, a third of 1F1B's 3 (p - 1),
/// so the makespan is 3 m + p - 1 and the bubble (p - 1) / (3 m + p - 1).
#[test]
fn zb_h1_bubble_is_a_third_of_1f1b() {
    for (p, m) in grid() {
        let zb = simulate(&zb_h1(p, m).unwrap(), &Costs::unit()).unwrap();
        let base = simulate(&one_f_one_b(p, m).unwrap(), &Costs::unit()).unwrap();
        assert!(
            close(zb.makespan, (3 * m + p - 1) as f64),
            "p={p} m={m}: {}",
            zb.makespan
        );
        for rank in 0..p {
            let idle = zb.makespan - zb.busy[rank];
            let idle_1f1b = base.makespan - base.busy[rank];
            assert!(
                close(idle, (p - 1) as f64),
                "p={p} m={m} rank {rank}: {idle}"
            );
            assert!(close(3.0 * idle, idle_1f1b), "p={p} m={m} rank {rank}");
        }
        assert!(close(
            zb.bubble_fraction,
            (p - 1) as f64 / (3 * m + p - 1) as f64
        ));
    }
}

/// ZBV with F = I = W = 1 per stage (two stages per rank): makespan 6 m + p - 1, the lower
/// bound (rank p - 1 cannot start before p - 1 and has 6 m of work), so the bubble is
/// (p - 1) / (6 m + p - 1): under 6% for m >= 2p at p <= 4, against 1F1B's 27% at p = 4,
/// m = 8.
#[test]
fn zbv_bubble_is_near_zero() {
    for (p, m) in grid() {
        let r = simulate(&zbv(p, m).unwrap(), &Costs::unit()).unwrap();
        assert!(
            close(r.makespan, (6 * m + p - 1) as f64),
            "p={p} m={m}: {}",
            r.makespan
        );
        let theory = (p - 1) as f64 / (6 * m + p - 1) as f64;
        assert!(close(r.bubble_fraction, theory), "p={p} m={m}");
        if m >= 2 * p {
            assert!(
                r.bubble_fraction < 0.06,
                "p={p} m={m}: {}",
                r.bubble_fraction
            );
        }
    }
}

/// GPipe holds every micro-batch; 1F1B holds at most p - r on rank r; ZB-H1 the same until
/// `I` and at most p until `W`; ZBV at most 2p stage activations (p micro-batches of a
/// rank's layers) everywhere.
#[test]
fn peak_activations() {
    for (p, m) in grid() {
        let g = simulate(&gpipe(p, m).unwrap(), &Costs::unit()).unwrap();
        assert_eq!(g.peak_activations, vec![m; p]);
        let o = simulate(&one_f_one_b(p, m).unwrap(), &Costs::unit()).unwrap();
        let bound: Vec<usize> = (0..p).map(|r| (p - r).min(m)).collect();
        assert_eq!(o.peak_activations, bound);
        assert_eq!(o.peak_microbatches_per_stage, bound);
        let z = simulate(&zb_h1(p, m).unwrap(), &Costs::unit()).unwrap();
        assert_eq!(z.peak_activations_until_input, bound);
        assert!(
            z.peak_activations.iter().all(|&n| n <= p),
            "{:?}",
            z.peak_activations
        );
        let v = simulate(&zbv(p, m).unwrap(), &Costs::unit()).unwrap();
        assert!(
            v.peak_activations.iter().all(|&n| n <= 2 * p),
            "{:?}",
            v.peak_activations
        );
    }
    // The memory case: p = 4, m = 8.
    let g = simulate(&gpipe(4, 8).unwrap(), &Costs::unit()).unwrap();
    let o = simulate(&one_f_one_b(4, 8).unwrap(), &Costs::unit()).unwrap();
    assert_eq!(g.peak_activations, [8, 8, 8, 8]);
    assert_eq!(o.peak_activations, [4, 3, 2, 1]);
}

/// GPipe with a communication latency c: the forward and the backward each cross p - 1
/// boundaries, so the makespan is 3 (m + p - 1) + 2 (p - 1) c.
#[test]
fn communication_latency() {
    for (p, m) in grid() {
        for c in [0.5, 2.0] {
            let r = simulate(&gpipe(p, m).unwrap(), &Costs::unit().with_comm(c)).unwrap();
            let theory = 3.0 * (m + p - 1) as f64 + 2.0 * (p - 1) as f64 * c;
            assert!(
                close(r.makespan, theory),
                "p={p} m={m} c={c}: {}",
                r.makespan
            );
        }
    }
}

#[test]
fn stage_scale_slows_one_stage() {
    let costs = Costs {
        stage_scale: vec![1.0, 2.0],
        ..Costs::unit()
    };
    let r = simulate(&one_f_one_b(2, 4).unwrap(), &costs).unwrap();
    assert!(
        close(r.busy[0], 12.0) && close(r.busy[1], 24.0),
        "{:?}",
        r.busy
    );
    // Rank 1 is the bottleneck: it starts at 1 and never waits after that.
    assert!(close(r.makespan, 1.0 + 24.0 + 2.0), "{}", r.makespan);
}

#[test]
fn text_timeline() {
    let r = simulate(&one_f_one_b(2, 2).unwrap(), &Costs::unit()).unwrap();
    let expected = "      t   0   1   2   3   4   5   6   7   8 \n \
                    rank 0 0F0 0F1   .   . 0B0 0B0   . 0B1 0B1 \n \
                    rank 1   . 1F0 1B0 1B0 1F1 1B1 1B1   .   . \n\
                    makespan 9.000, bubble 33.33%, peak activations per rank [2, 1]\n";
    assert_eq!(r.render(1.0), expected, "\n{}", r.render(1.0));
}

#[test]
fn chrome_trace_is_json_with_one_event_per_action() {
    let s = zbv(2, 4).unwrap();
    let r = simulate(&s, &Costs::unit()).unwrap();
    let trace: serde_json::Value = serde_json::from_str(&r.chrome_trace(1000.0)).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    let actions: usize = s.programs().iter().map(Vec::len).sum();
    assert_eq!(events.len(), actions + s.num_ranks());
    // Computations are complete events; a receive that waits is one too, in `comm`.
    let complete = events
        .iter()
        .filter(|e| e["ph"] == "X" && e["cat"] != "comm")
        .count();
    assert_eq!(
        complete,
        s.compute_programs().iter().map(Vec::len).sum::<usize>()
    );
    let waits = events
        .iter()
        .filter(|e| e["ph"] == "X" && e["cat"] == "comm")
        .count();
    let waiting = r
        .timeline
        .iter()
        .flatten()
        .filter(|span| !span.action.is_compute() && span.end > span.start)
        .count();
    assert!(
        waits > 0 && waits == waiting,
        "{waits} waits, {waiting} waiting receives"
    );
    assert!(
        events
            .iter()
            .any(|e| e["name"] == "SEND_F(0->1,m0)" && e["tid"] == 0)
    );
}
