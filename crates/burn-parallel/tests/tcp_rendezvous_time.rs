//! How long a 4-rank loopback `tcp` rendezvous takes (printed; run with `--nocapture`).

use std::thread;
use std::time::{Duration, Instant};

use burn_parallel::comm::tcp::JobToken;
use burn_parallel::world::{connect_tcp, connect_tcp_with_rendezvous};
use burn_parallel::{ReduceOp, TcpConfig, TcpRendezvous};

const RUNS: usize = 20;

#[test]
fn a_4_rank_rendezvous_takes_milliseconds() {
    let token = JobToken::generate().unwrap();
    for token in [None, Some(token)] {
        rendezvous_times(token);
    }
}

/// Forms `RUNS` 4-rank worlds, with `token` or without, and prints the times.
fn rendezvous_times(token: Option<JobToken>) {
    let world = 4;
    let label = if token.is_some() { "with" } else { "without" };
    let mut times = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        let rendezvous = TcpRendezvous::bind("127.0.0.1:0").unwrap();
        let port = rendezvous.port();
        let config = |rank| {
            let config = TcpConfig::new(rank, world, "127.0.0.1", port)
                .with_timeout(Duration::from_secs(20));
            match &token {
                Some(t) => config.with_job_token(t.clone()),
                None => config,
            }
        };
        let start = Instant::now();
        let groups = thread::scope(|scope| {
            let others: Vec<_> = (1..world)
                .map(|rank| scope.spawn(move || connect_tcp(&config(rank))))
                .collect();
            let mut groups = vec![connect_tcp_with_rendezvous(&config(0), rendezvous).unwrap()];
            groups.extend(others.into_iter().map(|h| h.join().unwrap().unwrap()));
            groups
        });
        times.push(start.elapsed());
        // The world works: one all-reduce, then drop every group at once.
        let sums = thread::scope(|scope| {
            let handles: Vec<_> = groups
                .into_iter()
                .map(|g| scope.spawn(move || g.all_reduce_f32(vec![1.0], ReduceOp::Sum).unwrap()))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        });
        assert!(sums.iter().all(|s| s == &[world as f32]));
    }
    times.sort();
    let median = times[RUNS / 2];
    println!(
        "4-rank loopback rendezvous {label} a job token, {RUNS} runs: min {:?}, median {median:?}, max {:?}",
        times[0],
        times[RUNS - 1]
    );
    assert!(median < Duration::from_secs(2), "median {median:?}");
}
