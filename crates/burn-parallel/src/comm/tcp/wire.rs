//! The byte format of the `tcp` backend's data connections.
//!
//! Every message is a fixed 48-byte header (little endian) followed by the signature (UTF-8),
//! the metadata (`u64` each) and the payload:
//!
//! | bytes  | field                                         |
//! |--------|-----------------------------------------------|
//! | 0..4   | magic `0x4250_4652` ("BPFR")                  |
//! | 4      | format version ([`VERSION`])                  |
//! | 5      | kind: 0 data, 1 goodbye, 2 abort              |
//! | 6..8   | reserved, zero                                |
//! | 8..16  | stream group                                  |
//! | 16..24 | stream tag                                    |
//! | 24..32 | call number (`seq`); for an abort, the origin |
//! | 32..36 | signature length in bytes                     |
//! | 36..40 | number of metadata words                      |
//! | 40..48 | payload length in bytes                       |
//!
//! A goodbye carries nothing; an abort carries the rank where the failure originated in the
//! `seq` field and its reason (UTF-8) as payload. The header and
//! the payload leave in one vectored write, straight from the frame's buffer; the receiver
//! reads the payload into one buffer sized from the header, taken from the process-wide
//! buffer pool ([`crate::comm::pool`]).

use std::io::{self, IoSlice, Read, Write};

use bytes::Bytes;

use crate::comm::pool;
use crate::comm::transport::{Frame, Header, StreamId};

/// First four bytes of every frame.
pub(crate) const MAGIC: u32 = 0x4250_4652;
/// Version of the frame format; a peer speaking another version is refused.
pub(crate) const VERSION: u8 = 1;
/// Size of the fixed part of a frame header.
pub(crate) const HEADER_LEN: usize = 48;
/// Longest signature accepted.
pub(crate) const MAX_SIGNATURE: usize = 64 * 1024;
/// Most metadata words accepted.
pub(crate) const MAX_META: usize = 64 * 1024;
/// Largest payload accepted (1 TiB): anything larger is a corrupted header.
pub(crate) const MAX_PAYLOAD: u64 = 1 << 40;
/// Largest abort reason accepted.
const MAX_REASON: u64 = 1 << 20;

const KIND_DATA: u8 = 0;
const KIND_GOODBYE: u8 = 1;
const KIND_ABORT: u8 = 2;

/// What a peer sent.
#[derive(Debug)]
pub(crate) enum Incoming {
    /// A message for the mailbox.
    Data(Frame),
    /// The peer shut down cleanly; nothing follows.
    Goodbye,
    /// The world failed: rank `origin` (the peer, or the rank whose failure stopped the peer)
    /// failed for `reason`.
    Abort {
        /// Where the failure started.
        origin: u64,
        /// Why.
        reason: String,
    },
}

/// Why reading a frame failed.
#[derive(Debug)]
pub(crate) enum ReadError {
    /// The connection failed (reset, or closed in the middle of a frame).
    Io(io::Error),
    /// The bytes are not a frame of this format.
    Malformed(String),
}

fn put_u32(buf: &mut Vec<u8>, v: u32) {
    buf.extend_from_slice(&v.to_le_bytes());
}

fn put_u64(buf: &mut Vec<u8>, v: u64) {
    buf.extend_from_slice(&v.to_le_bytes());
}

/// Encodes the header, signature and metadata of a frame of `kind` with a payload of
/// `payload_len` bytes.
fn encode_head(kind: u8, header: Option<&Header>, payload_len: usize) -> Vec<u8> {
    let (group, tag, seq, signature, meta): (u64, u64, u64, &[u8], &[u64]) = match header {
        Some(h) => (
            h.stream.group,
            h.stream.tag,
            h.seq,
            h.signature.as_bytes(),
            &h.meta,
        ),
        None => (0, 0, 0, &[], &[]),
    };
    let mut buf = Vec::with_capacity(HEADER_LEN + signature.len() + 8 * meta.len());
    put_u32(&mut buf, MAGIC);
    buf.push(VERSION);
    buf.push(kind);
    buf.extend_from_slice(&[0, 0]);
    put_u64(&mut buf, group);
    put_u64(&mut buf, tag);
    put_u64(&mut buf, seq);
    put_u32(&mut buf, signature.len() as u32);
    put_u32(&mut buf, meta.len() as u32);
    put_u64(&mut buf, payload_len as u64);
    buf.extend_from_slice(signature);
    for &m in meta {
        put_u64(&mut buf, m);
    }
    buf
}

/// Writes every byte of `bufs`, in as few system calls as the socket allows.
fn write_all_vectored(w: &mut impl Write, mut bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        match w.write_vectored(bufs) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "the connection accepted no more bytes",
                ));
            }
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Checks that a frame can be encoded (lengths within the limits the receiver enforces).
pub(crate) fn check_encodable(frame: &Frame) -> Result<(), String> {
    if frame.header.signature.len() > MAX_SIGNATURE {
        return Err(format!(
            "the signature has {} bytes, more than the {MAX_SIGNATURE} a frame can carry",
            frame.header.signature.len()
        ));
    }
    if frame.header.meta.len() > MAX_META {
        return Err(format!(
            "the metadata has {} words, more than the {MAX_META} a frame can carry",
            frame.header.meta.len()
        ));
    }
    if frame.payload.len() as u64 > MAX_PAYLOAD {
        return Err(format!(
            "the payload has {} bytes, more than the {MAX_PAYLOAD} a frame can carry",
            frame.payload.len()
        ));
    }
    Ok(())
}

/// Writes a data frame: header, signature and metadata, then the payload straight from the
/// frame's buffer (no copy).
pub(crate) fn write_data(w: &mut impl Write, frame: &Frame) -> io::Result<()> {
    let head = encode_head(KIND_DATA, Some(&frame.header), frame.payload.len());
    write_all_vectored(w, &mut [IoSlice::new(&head), IoSlice::new(&frame.payload)])
}

/// Writes a goodbye frame.
pub(crate) fn write_goodbye(w: &mut impl Write) -> io::Result<()> {
    w.write_all(&encode_head(KIND_GOODBYE, None, 0))
}

/// Writes an abort frame saying that rank `origin` failed for `reason` (truncated to 1 MiB).
pub(crate) fn write_abort(w: &mut impl Write, origin: usize, reason: &str) -> io::Result<()> {
    let mut end = reason.len().min(MAX_REASON as usize);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let reason = &reason.as_bytes()[..end];
    let mut head = encode_head(KIND_ABORT, None, reason.len());
    head[24..32].copy_from_slice(&(origin as u64).to_le_bytes());
    write_all_vectored(w, &mut [IoSlice::new(&head), IoSlice::new(reason)])
}

fn u32_at(buf: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(buf[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(buf: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(buf[at..at + 8].try_into().expect("8 bytes"))
}

/// Asks the kernel to back a large buffer with transparent huge pages: a fresh buffer's first
/// touch then costs one fault per 2 MiB instead of one per 4 KiB, which on some machines
/// (virtual machines especially) is the largest cost of receiving a payload. Harmless on a
/// buffer that is already backed.
#[cfg(target_os = "linux")]
fn advise_huge_pages(buf: &mut [std::mem::MaybeUninit<u8>]) {
    const HUGE: usize = 2 << 20;
    if buf.len() < 2 * HUGE {
        return;
    }
    let start = buf.as_mut_ptr() as usize;
    let end = start + buf.len();
    // madvise needs a page-aligned start; only whole huge pages can use huge pages anyway.
    let aligned_start = start.next_multiple_of(HUGE);
    let aligned_end = end - end % HUGE;
    if aligned_end <= aligned_start {
        return;
    }
    // SAFETY: the range lies inside `buf`, which we borrow exclusively. MADV_HUGEPAGE is
    // advisory: it changes neither the contents nor the validity of the memory, only how the
    // kernel backs it; a failure (e.g. THP disabled) is harmless and ignored.
    unsafe {
        libc::madvise(
            aligned_start as *mut libc::c_void,
            aligned_end - aligned_start,
            libc::MADV_HUGEPAGE,
        );
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge_pages(_buf: &mut [std::mem::MaybeUninit<u8>]) {}

/// [`advise_huge_pages`] for initialised memory.
fn advise_huge_pages_init(buf: &mut [u8]) {
    // SAFETY: `u8` and `MaybeUninit<u8>` have the same layout, and the advice never writes.
    let uninit = unsafe {
        std::slice::from_raw_parts_mut(
            buf.as_mut_ptr().cast::<std::mem::MaybeUninit<u8>>(),
            buf.len(),
        )
    };
    advise_huge_pages(uninit);
}

/// Reads exactly `len` bytes into a fresh vector (for lengths the pool cannot serve). The
/// allocation is fallible, so that a corrupted length is an error rather than an abort.
fn read_vec(r: &mut impl Read, len: u64, what: &str) -> Result<Vec<u8>, ReadError> {
    let mut buf = Vec::new();
    buf.try_reserve_exact(len as usize).map_err(|_| {
        ReadError::Malformed(format!(
            "cannot allocate {len} bytes for the {what} (corrupted header?)"
        ))
    })?;
    advise_huge_pages(buf.spare_capacity_mut());
    // Reads into the spare capacity, without zero-filling it first.
    let read = r.take(len).read_to_end(&mut buf).map_err(ReadError::Io)?;
    if read as u64 != len {
        return Err(ReadError::Io(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("the connection closed after {read} of the {len} bytes of a {what}"),
        )));
    }
    Ok(buf)
}

/// Reads a payload of `len` bytes into one buffer sized from the header: a buffer of the
/// process-wide pool (recycled when the last reference to the payload is dropped, so that
/// steady traffic touches no fresh memory) or, beyond what the pool keeps, a fresh vector.
fn read_payload(r: &mut impl Read, len: u64) -> Result<Bytes, ReadError> {
    if len > pool::MAX_POOLED_BYTES as u64 {
        return read_vec(r, len, "payload").map(Bytes::from);
    }
    let mut buf = pool::take(len as usize);
    advise_huge_pages_init(&mut buf);
    r.read_exact(&mut buf).map_err(ReadError::Io)?;
    Ok(pool::share(buf))
}

/// Reads the next frame. `Ok(None)` is a clean end of stream (at a frame boundary).
pub(crate) fn read_frame(r: &mut impl Read) -> Result<Option<Incoming>, ReadError> {
    let mut head = [0u8; HEADER_LEN];
    let mut filled = 0;
    while filled < HEADER_LEN {
        match r.read(&mut head[filled..]) {
            Ok(0) if filled == 0 => return Ok(None),
            Ok(0) => {
                return Err(ReadError::Io(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("the connection closed after {filled} bytes of a frame header"),
                )));
            }
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(ReadError::Io(e)),
        }
    }
    let magic = u32_at(&head, 0);
    if magic != MAGIC {
        return Err(ReadError::Malformed(format!(
            "bad magic number {magic:#010x} (expected {MAGIC:#010x}): not a burn-parallel frame"
        )));
    }
    if head[4] != VERSION {
        return Err(ReadError::Malformed(format!(
            "frame format version {} (this build speaks version {VERSION}): mixed builds?",
            head[4]
        )));
    }
    let kind = head[5];
    let sig_len = u32_at(&head, 32) as usize;
    let meta_len = u32_at(&head, 36) as usize;
    let payload_len = u64_at(&head, 40);
    if sig_len > MAX_SIGNATURE {
        return Err(ReadError::Malformed(format!(
            "signature length {sig_len} exceeds {MAX_SIGNATURE}"
        )));
    }
    if meta_len > MAX_META {
        return Err(ReadError::Malformed(format!(
            "metadata length {meta_len} exceeds {MAX_META}"
        )));
    }
    if payload_len > MAX_PAYLOAD {
        return Err(ReadError::Malformed(format!(
            "payload length {payload_len} exceeds {MAX_PAYLOAD}"
        )));
    }
    match kind {
        KIND_DATA => {
            let mut sig = vec![0u8; sig_len];
            r.read_exact(&mut sig).map_err(ReadError::Io)?;
            let signature = String::from_utf8(sig).map_err(|e| {
                ReadError::Malformed(format!("the signature is not valid UTF-8: {e}"))
            })?;
            let mut meta_bytes = vec![0u8; 8 * meta_len];
            r.read_exact(&mut meta_bytes).map_err(ReadError::Io)?;
            let meta = meta_bytes
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect();
            let payload = read_payload(r, payload_len)?;
            Ok(Some(Incoming::Data(Frame {
                header: Header {
                    stream: StreamId {
                        group: u64_at(&head, 8),
                        tag: u64_at(&head, 16),
                    },
                    seq: u64_at(&head, 24),
                    signature,
                    meta,
                },
                payload,
            })))
        }
        KIND_GOODBYE | KIND_ABORT if sig_len != 0 || meta_len != 0 => Err(ReadError::Malformed(
            format!("control frame of kind {kind} with a signature or metadata"),
        )),
        KIND_GOODBYE if payload_len != 0 => Err(ReadError::Malformed(
            "goodbye frame with a payload".to_string(),
        )),
        KIND_GOODBYE => Ok(Some(Incoming::Goodbye)),
        KIND_ABORT if payload_len > MAX_REASON => Err(ReadError::Malformed(format!(
            "abort reason of {payload_len} bytes exceeds {MAX_REASON}"
        ))),
        KIND_ABORT => {
            let reason = read_vec(r, payload_len, "abort reason")?;
            let reason = String::from_utf8(reason).map_err(|e| {
                ReadError::Malformed(format!("the abort reason is not valid UTF-8: {e}"))
            })?;
            Ok(Some(Incoming::Abort {
                origin: u64_at(&head, 24),
                reason,
            }))
        }
        other => Err(ReadError::Malformed(format!("unknown frame kind {other}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(payload: &[u8]) -> Frame {
        Frame {
            header: Header {
                stream: StreamId { group: 7, tag: 9 },
                seq: 3,
                signature: "all_reduce(#3 sum f32[4])".into(),
                meta: vec![1, 2, u64::MAX],
            },
            payload: Bytes::copy_from_slice(payload),
        }
    }

    #[test]
    fn frames_round_trip() {
        let mut wire = Vec::new();
        write_data(&mut wire, &frame(b"hello")).unwrap();
        write_abort(&mut wire, 2, "rank 2 panicked: boom").unwrap();
        write_goodbye(&mut wire).unwrap();
        let mut r = &wire[..];
        match read_frame(&mut r).unwrap() {
            Some(Incoming::Data(f)) => {
                assert_eq!(f.header, frame(b"").header);
                assert_eq!(&f.payload[..], b"hello");
            }
            other => panic!("expected data, got {other:?}"),
        }
        assert!(matches!(
            read_frame(&mut r).unwrap(),
            Some(Incoming::Abort { origin: 2, reason }) if reason == "rank 2 panicked: boom"
        ));
        assert!(matches!(
            read_frame(&mut r).unwrap(),
            Some(Incoming::Goodbye)
        ));
        assert!(read_frame(&mut r).unwrap().is_none());
    }

    fn malformed(wire: &[u8]) -> String {
        match read_frame(&mut &wire[..]) {
            Err(ReadError::Malformed(m)) => m,
            other => panic!("expected a malformed frame, got {other:?}"),
        }
    }

    #[test]
    fn malformed_frames_are_rejected() {
        let mut good = Vec::new();
        write_data(&mut good, &frame(b"abc")).unwrap();

        let mut bad_magic = good.clone();
        bad_magic[0] ^= 0xff;
        assert!(malformed(&bad_magic).contains("bad magic"));

        let mut bad_version = good.clone();
        bad_version[4] = 99;
        assert!(malformed(&bad_version).contains("version 99"));

        let mut absurd = good.clone();
        absurd[40..48].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(malformed(&absurd).contains("payload length"));

        let mut bad_utf8 = good.clone();
        bad_utf8[HEADER_LEN] = 0xff;
        assert!(malformed(&bad_utf8).contains("UTF-8"));

        let mut bad_kind = good.clone();
        bad_kind[5] = 42;
        assert!(malformed(&bad_kind).contains("kind 42"));
    }

    #[test]
    fn truncated_frames_are_io_errors() {
        let mut good = Vec::new();
        write_data(&mut good, &frame(b"abcdef")).unwrap();
        for cut in [1, HEADER_LEN - 1, HEADER_LEN + 3, good.len() - 1] {
            assert!(
                matches!(read_frame(&mut &good[..cut]), Err(ReadError::Io(_))),
                "cut at {cut}"
            );
        }
    }
}
