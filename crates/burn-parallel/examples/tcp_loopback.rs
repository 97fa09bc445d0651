//! Raw TCP throughput between two processes on this machine: the ceiling for the `tcp`
//! backend's collectives ("machine limit" of the collectives benchmark).
//!
//! ```text
//! cargo run --release -p burn-parallel --example tcp_loopback -- [--bytes N] [--iters K] [--bidirectional] [--json]
//! ```
//!
//! The process listens on 127.0.0.1, starts a copy of itself that connects and writes `K`
//! messages of `N` bytes (default 64 MiB, 10 messages, after one unmeasured message), and reads
//! them into one reused buffer: no allocation or copy beyond the kernel's. The sockets are set
//! up as the `tcp` backend sets up its own (`TCP_NODELAY`, `BURN_PARALLEL_TCP_SOCKET_BUFFER`).
//! It prints the throughput in MB/s (10^6 bytes per second), or one JSON object with `--json`.
//!
//! With `--bidirectional`, both processes send and receive at the same time (as every rank of a
//! ring collective does) and the figure is the throughput of one direction. On a machine with
//! few cores, loopback TCP is bound by the kernel's copies, so this is the fair ceiling for the
//! bus bandwidth of a ring all-reduce.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::thread;
use std::time::Instant;

struct Options {
    bytes: usize,
    iters: usize,
    json: bool,
    bidirectional: bool,
    /// Set in the child: the port to send to.
    send_to: Option<u16>,
}

fn parse() -> Result<Options, String> {
    let usage = "usage: tcp_loopback [--bytes N] [--iters K] [--bidirectional] [--json]";
    let mut options = Options {
        bytes: 64 << 20,
        iters: 10,
        json: false,
        bidirectional: false,
        send_to: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || -> Result<usize, String> {
            args.next()
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| usage.to_string())
        };
        match arg.as_str() {
            "--bytes" => options.bytes = value()?.max(1),
            "--iters" => options.iters = value()?.max(1),
            "--json" => options.json = true,
            "--bidirectional" => options.bidirectional = true,
            "--send-to" => {
                options.send_to = Some(u16::try_from(value()?).map_err(|_| usage.to_string())?)
            }
            _ => return Err(usage.to_string()),
        }
    }
    Ok(options)
}

fn configure(stream: &TcpStream) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    if let Some(bytes) = std::env::var("BURN_PARALLEL_TCP_SOCKET_BUFFER")
        .ok()
        .and_then(|s| s.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
    {
        let sock = socket2::SockRef::from(stream);
        sock.set_send_buffer_size(bytes)?;
        sock.set_recv_buffer_size(bytes)?;
    }
    Ok(())
}

/// Writes `iters + 1` messages of `bytes` bytes.
fn write_messages(stream: &mut TcpStream, bytes: usize, iters: usize) -> std::io::Result<()> {
    let message: Vec<u8> = (0..bytes).map(|i| i as u8).collect();
    for _ in 0..=iters {
        stream.write_all(&message)?;
    }
    Ok(())
}

/// Reads `iters + 1` messages into one buffer; returns the time of the last `iters`.
fn read_messages(stream: &mut TcpStream, bytes: usize, iters: usize) -> std::io::Result<f64> {
    let mut buffer = vec![0u8; bytes];
    // One unmeasured message: connection warm-up, page faults of the buffer.
    stream.read_exact(&mut buffer)?;
    let start = Instant::now();
    for _ in 0..iters {
        stream.read_exact(&mut buffer)?;
    }
    Ok(start.elapsed().as_secs_f64())
}

/// Sends (and in bidirectional mode also receives) over `stream`; returns the receive time.
fn exchange(
    stream: &mut TcpStream,
    options: &Options,
    send: bool,
    receive: bool,
) -> std::io::Result<Option<f64>> {
    let (bytes, iters) = (options.bytes, options.iters);
    let mut writer = stream.try_clone()?;
    let sender = thread::spawn(move || {
        if send {
            write_messages(&mut writer, bytes, iters)
        } else {
            Ok(())
        }
    });
    let seconds = if receive {
        Some(read_messages(stream, bytes, iters)?)
    } else {
        None
    };
    sender
        .join()
        .map_err(|_| std::io::Error::other("the sender panicked"))??;
    Ok(seconds)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let options = parse()?;
    if let Some(port) = options.send_to {
        let mut stream = TcpStream::connect(("127.0.0.1", port))?;
        configure(&stream)?;
        exchange(&mut stream, &options, true, options.bidirectional)?;
        // Wait for the parent's acknowledgement so that closing cannot cut the last message.
        let mut ack = [0u8; 1];
        stream.read_exact(&mut ack)?;
        return Ok(());
    }
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--send-to", &port.to_string()])
        .args(["--bytes", &options.bytes.to_string()])
        .args(["--iters", &options.iters.to_string()])
        .args(options.bidirectional.then_some("--bidirectional"))
        .stdin(Stdio::null())
        .spawn()?;
    let (mut stream, _) = listener.accept()?;
    configure(&stream)?;
    let seconds = exchange(&mut stream, &options, options.bidirectional, true)?.expect("received");
    stream.write_all(&[1])?;
    let status = child.wait()?;
    if !status.success() {
        return Err(format!("the other process failed: {status}").into());
    }
    let total = (options.bytes * options.iters) as f64;
    let mb_per_s = total / seconds / 1e6;
    let mode = if options.bidirectional {
        "bidirectional"
    } else {
        "unidirectional"
    };
    if options.json {
        println!(
            "{{\"benchmark\":\"tcp_loopback\",\"mode\":\"{mode}\",\"bytes\":{},\"iters\":{},\"seconds\":{seconds:.6},\"mb_per_s\":{mb_per_s:.1}}}",
            options.bytes, options.iters
        );
    } else {
        println!(
            "raw TCP loopback between 2 processes, {mode}: {mb_per_s:.0} MB/s per direction \
             ({} x {} bytes in {seconds:.3} s)",
            options.iters, options.bytes
        );
    }
    Ok(())
}
