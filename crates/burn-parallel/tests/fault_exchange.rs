//! What the fault-tolerant exchange ([`Replicas::average`]: the direct reduce-scatter and
//! all-gather, the votes and the view round) costs against the data-parallel all-reduce it
//! replaces, on the same bytes, over loopback TCP between two thread ranks of this process:
//! the communication alone, without the compute noise of whole training runs. The GPT
//! trainer's default model has 470k parameters (1.88 MB of gradients per step).
//!
//! `cargo test -p burn-parallel --test fault_exchange -- --nocapture` prints the medians.

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use burn::tensor::TensorData;
use burn_parallel::comm::tcp::TcpTransport;
use burn_parallel::fault::Replicas;
use burn_parallel::{ProcessGroup, ReduceOp, TcpConfig, TcpRendezvous};

const VALUES: usize = 470_000;
const REPS: usize = 40;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One rank's times of the all-reduce and of the exchange, and their last results.
type Timed = (Vec<f64>, Vec<f64>, Vec<f32>, Vec<f32>);

#[test]
fn the_exchange_costs_about_what_the_all_reduce_costs() {
    let rendezvous = TcpRendezvous::bind("127.0.0.1:0").unwrap();
    let port = rendezvous.port();
    let mut rendezvous = Some(rendezvous);
    let results: Vec<Timed> = thread::scope(|scope| {
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                let rendezvous = if rank == 0 { rendezvous.take() } else { None };
                scope.spawn(move || {
                    let config = TcpConfig::new(rank, 2, "127.0.0.1", port)
                        .with_timeout(Duration::from_secs(10));
                    let transport = TcpTransport::connect(&config, rendezvous).unwrap();
                    let world = ProcessGroup::world(transport as Arc<_>)
                        .with_timeout(Duration::from_secs(10));
                    let replicas = Replicas::new(&world, 2).unwrap();
                    let mine: Vec<f32> = (0..VALUES).map(|i| (i % 97 + rank) as f32).collect();
                    let (mut ring, mut exchange) = (Vec::new(), Vec::new());
                    let (mut by_ring, mut by_exchange) = (Vec::new(), Vec::new());
                    for _ in 0..REPS {
                        let start = Instant::now();
                        let data = TensorData::new(mine.clone(), [VALUES]);
                        by_ring = world
                            .all_reduce_data(data, ReduceOp::Avg)
                            .unwrap()
                            .try_to_vec::<f32>()
                            .unwrap();
                        ring.push(start.elapsed().as_secs_f64());
                        let start = Instant::now();
                        by_exchange = replicas.average(&mine).unwrap();
                        exchange.push(start.elapsed().as_secs_f64());
                    }
                    (ring, exchange, by_ring, by_exchange)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let (ring, exchange, by_ring, by_exchange) = &results[0];
    // The same average (up to the order of the additions), the same bits on both ranks.
    assert_eq!(by_exchange, &results[1].3);
    for (a, b) in by_ring.iter().zip(by_exchange) {
        assert!((a - b).abs() <= 1e-6 * a.abs().max(1.0), "{a} vs {b}");
    }
    let (r, e) = (median(ring.clone()), median(exchange.clone()));
    println!(
        "{VALUES} f32 over 2 TCP ranks, median of {REPS}: all-reduce {:.3} ms, fault-tolerant \
         exchange {:.3} ms ({:+.3} ms; {:+.2}% of a 100 ms step)",
        r * 1e3,
        e * 1e3,
        (e - r) * 1e3,
        (e - r) / 0.1 * 100.0
    );
}
