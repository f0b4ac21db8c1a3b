//! TLS 1.3 record protection for link connections (RFC 8446 §5), once rustls has completed the
//! handshake ([`crate::handshake`]).
//!
//! Why not rustls's own record layer: it copies the plaintext into each record before sealing it
//! and copies every opened record out again. Links carry bulk traffic, and those two copies of
//! cold memory were 14% of the sending site's CPU and 7% of the receiving one's. Here a record
//! is sealed straight from the caller's buffer into the outgoing buffer and opened straight from
//! the incoming buffer into the caller's (aws-lc-rs seals and opens out of place), and the
//! socket is read in large chunks rather than one record at a time. rustls keeps the secrets:
//! key updates are derived by its [`KernelConnection`].

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use aws_lc_rs::aead::{
    AES_128_GCM, AES_256_GCM, Aad, Algorithm, CHACHA20_POLY1305, LessSafeKey, Nonce, UnboundKey,
};
use rustls::kernel::KernelConnection;
use rustls::{ConnectionTrafficSecrets, ExtractedSecrets};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Largest plaintext of one record (RFC 8446 §5.1).
const MAX_PLAIN: usize = 1 << 14;
/// Largest ciphertext length a record header may announce (RFC 8446 §5.2).
const MAX_CIPHERTEXT: usize = MAX_PLAIN + 256;
const HEADER: usize = 5;
/// Header, largest plaintext, content type and the longest tag: the most one sealed record takes.
const MAX_SEALED: usize = HEADER + MAX_PLAIN + 1 + 16;
/// Sealed records waiting for the socket. As large as the HTTP/2 frames on a link, so a frame is
/// sealed in one run and written in one system call.
const OUT_CAPACITY: usize = (2 << 20) + 64 * MAX_SEALED;
/// Room kept free before sealing: a record, the gathered small slices before it, and a key
/// update (or close_notify).
const SEAL_ROOM: usize = 3 * MAX_SEALED;
/// How much of the socket is read at once: about two records. On two linked sites (one iperf3
/// stream) 32 KiB carried 7% more than 64 KiB and 10% more than 128 KiB: smaller reads let the
/// receiving site open and pass on a frame's records while the rest are still arriving, and
/// what they read is still in cache when opened. One record (16 KiB) read ~3% less.
const IN_CAPACITY: usize = 32 << 10;
/// The incoming buffer holds many reads: the incomplete record a read leaves at its end is moved
/// to the front only when the buffer's tail has no room for another read, so that move (up to a
/// record) is paid once per 15 reads rather than after nearly every one (it was 1.2% of the
/// sites' CPU on a bulk link).
const IN_BUFFER: usize = 16 * IN_CAPACITY;
/// Slices shorter than this (HTTP/2 frame headers, small frames) are gathered into one record
/// rather than sealed alone.
const GATHER_BELOW: usize = 1024;
/// Handshake messages after the handshake (key updates, tickets) are small; a peer that sends
/// more than this without completing one is refused.
const MAX_HANDSHAKE_MESSAGE: usize = 64 << 10;

const APPLICATION_DATA: u8 = 23;
const ALERT: u8 = 21;
const HANDSHAKE: u8 = 22;
const KEY_UPDATE: u8 = 24;
const NEW_SESSION_TICKET: u8 = 4;
const CLOSE_NOTIFY: u8 = 0;
const USER_CANCELED: u8 = 90;

/// Derives the next traffic secrets of a direction after a key update.
pub(crate) trait KeyUpdates: Send {
    fn next_tx(&mut self) -> Result<ConnectionTrafficSecrets, rustls::Error>;
    fn next_rx(&mut self) -> Result<ConnectionTrafficSecrets, rustls::Error>;
}

impl<Data: Send> KeyUpdates for KernelConnection<Data> {
    fn next_tx(&mut self) -> Result<ConnectionTrafficSecrets, rustls::Error> {
        self.update_tx_secret().map(|(_, s)| s)
    }
    fn next_rx(&mut self) -> Result<ConnectionTrafficSecrets, rustls::Error> {
        self.update_rx_secret().map(|(_, s)| s)
    }
}

/// One direction's key, static IV and sequence number.
struct Direction {
    key: LessSafeKey,
    iv: [u8; 12],
    seq: u64,
}

impl Direction {
    fn new(seq: u64, secrets: ConnectionTrafficSecrets) -> io::Result<Self> {
        let (alg, key, iv): (&'static Algorithm, _, _) = match &secrets {
            ConnectionTrafficSecrets::Aes128Gcm { key, iv } => (&AES_128_GCM, key, iv),
            ConnectionTrafficSecrets::Aes256Gcm { key, iv } => (&AES_256_GCM, key, iv),
            ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => (&CHACHA20_POLY1305, key, iv),
            _ => return Err(invalid("cipher suite not supported on links")),
        };
        let key = UnboundKey::new(alg, key.as_ref())
            .map_err(|_| invalid("traffic key of the wrong length"))?;
        let iv = iv
            .as_ref()
            .try_into()
            .map_err(|_| invalid("traffic IV of the wrong length"))?;
        Ok(Self {
            key: LessSafeKey::new(key),
            iv,
            seq,
        })
    }

    /// The per-record nonce: the static IV XOR the sequence number (RFC 8446 §5.3). Each
    /// sequence number is used once: this advances it.
    fn next_nonce(&mut self) -> io::Result<Nonce> {
        let mut nonce = self.iv;
        for (n, s) in nonce[4..].iter_mut().zip(self.seq.to_be_bytes()) {
            *n ^= s;
        }
        self.seq = self
            .seq
            .checked_add(1)
            .ok_or_else(|| invalid("record sequence number exhausted"))?;
        Ok(Nonce::assume_unique_for_key(nonce))
    }

    fn tag_len(&self) -> usize {
        self.key.algorithm().tag_len()
    }
}

/// A link connection after its handshake: reads and writes application data in TLS 1.3 records.
pub(crate) struct RecordStream<IO> {
    io: IO,
    updates: Box<dyn KeyUpdates>,
    tx: Direction,
    rx: Direction,
    /// Records sent before the sending key is replaced (below the suite's confidentiality limit).
    update_after: u64,
    /// The peer asked for our key update (RFC 8446 §4.6.3); sent before the next record.
    update_requested: bool,

    /// Ciphertext read from the socket: `input[in_start..in_end]` is not yet opened.
    input: Box<[u8]>,
    in_start: usize,
    in_end: usize,
    /// A record that did not fit the caller's buffer is opened here (and what rustls opened
    /// before the hand-over waits here); `spill[spill_start..spill_end]` is not yet read.
    spill: Box<[u8]>,
    spill_start: usize,
    spill_end: usize,
    /// Post-handshake handshake messages, possibly split across records.
    handshake: Vec<u8>,
    peer_closed: bool,
    /// Why reading failed: the connection is unusable from that record on.
    failed: Option<(io::ErrorKind, String)>,

    /// Sealed records: `output[out_start..out_end]` is not yet written.
    output: Box<[u8]>,
    out_start: usize,
    out_end: usize,
    /// Small slices gathered into the next record.
    gather: Vec<u8>,
    close_sent: bool,
}

impl<IO> RecordStream<IO> {
    /// `received`: bytes read from the socket after the handshake's last record, not yet opened;
    /// `opened`: application data rustls opened before the handshake was handed over, read first.
    pub(crate) fn new(
        io: IO,
        secrets: ExtractedSecrets,
        updates: Box<dyn KeyUpdates>,
        confidentiality_limit: u64,
        received: &[u8],
        mut opened: Vec<u8>,
    ) -> io::Result<Self> {
        let ExtractedSecrets {
            tx: (tx_seq, tx),
            rx: (rx_seq, rx),
        } = secrets;
        // What the handshake read after its last record is at most one of its reads.
        let mut input = vec![0u8; IN_BUFFER.max(received.len())].into_boxed_slice();
        let opened_len = opened.len();
        opened.resize(opened_len.max(MAX_CIPHERTEXT), 0);
        input[..received.len()].copy_from_slice(received);
        Ok(Self {
            io,
            updates,
            tx: Direction::new(tx_seq, tx)?,
            rx: Direction::new(rx_seq, rx)?,
            // Well below the limit: a key update costs one small record.
            update_after: confidentiality_limit / 2,
            update_requested: false,
            input,
            in_start: 0,
            in_end: received.len(),
            spill: opened.into_boxed_slice(),
            spill_start: 0,
            spill_end: opened_len,
            handshake: Vec::new(),
            peer_closed: false,
            failed: None,
            output: vec![0u8; OUT_CAPACITY].into_boxed_slice(),
            out_start: 0,
            out_end: 0,
            gather: Vec::with_capacity(MAX_PLAIN),
            close_sent: false,
        })
    }

    #[cfg(test)]
    pub(crate) fn set_update_after(&mut self, records: u64) {
        self.update_after = records;
    }

    /// Seals one record of `content_type` from `plain` at the end of the output buffer, which
    /// must have room for it; sends a key update first when one is due.
    fn seal(&mut self, content_type: u8, plain: &[u8]) -> io::Result<()> {
        if self.tx.seq >= self.update_after || self.update_requested {
            self.update_requested = false;
            // KeyUpdate, update_not_requested (RFC 8446 §4.6.3), under the current key.
            self.seal_one(HANDSHAKE, &[KEY_UPDATE, 0, 0, 1, 0])?;
            let next = self.updates.next_tx().map_err(tls_error)?;
            self.tx = Direction::new(0, next)?;
        }
        self.seal_one(content_type, plain)
    }

    fn seal_one(&mut self, content_type: u8, plain: &[u8]) -> io::Result<()> {
        let tag_len = self.tx.tag_len();
        let sealed_len = plain.len() + 1 + tag_len;
        let header = [
            APPLICATION_DATA,
            3,
            3,
            (sealed_len >> 8) as u8,
            sealed_len as u8,
        ];
        let nonce = self.tx.next_nonce()?;
        let record = &mut self.output[self.out_end..self.out_end + HEADER + sealed_len];
        let (head, body) = record.split_at_mut(HEADER);
        head.copy_from_slice(&header);
        let (ciphertext, type_and_tag) = body.split_at_mut(plain.len());
        self.tx
            .key
            .seal_out_of_place_scatter(
                nonce,
                Aad::from(header),
                plain,
                ciphertext,
                &[content_type],
                type_and_tag,
            )
            .map_err(|_| invalid("sealing a record failed"))?;
        self.out_end += HEADER + sealed_len;
        Ok(())
    }

    fn room(&self) -> usize {
        OUT_CAPACITY - self.out_end
    }

    /// Seals the gathered small slices, if any, into one record.
    fn seal_gathered(&mut self) -> io::Result<()> {
        if self.gather.is_empty() {
            return Ok(());
        }
        let gathered = std::mem::take(&mut self.gather);
        let sealed = self.seal(APPLICATION_DATA, &gathered);
        self.gather = gathered;
        self.gather.clear();
        sealed
    }

    /// Seals as much of `bufs` as the output buffer has room for; returns how much.
    fn seal_slices(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        let mut taken = 0;
        'slices: for buf in bufs {
            let mut rest: &[u8] = buf;
            while !rest.is_empty() {
                if self.room() < SEAL_ROOM {
                    break 'slices;
                }
                if rest.len() < GATHER_BELOW {
                    let n = rest.len().min(MAX_PLAIN - self.gather.len());
                    self.gather.extend_from_slice(&rest[..n]);
                    if self.gather.len() == MAX_PLAIN {
                        self.seal_gathered()?;
                    }
                    rest = &rest[n..];
                    taken += n;
                } else {
                    self.seal_gathered()?;
                    let n = rest.len().min(MAX_PLAIN);
                    self.seal(APPLICATION_DATA, &rest[..n])?;
                    rest = &rest[n..];
                    taken += n;
                }
            }
        }
        self.seal_gathered()?;
        Ok(taken)
    }

    /// Opens the complete records in the input buffer into `buf` (or the spill buffer, for a
    /// record larger than the room left in `buf`), until `buf` is full or a record is incomplete.
    fn open_records(&mut self, buf: &mut ReadBuf<'_>) -> io::Result<()> {
        while buf.remaining() > 0 && !self.peer_closed && self.spill_start == self.spill_end {
            let available = &self.input[self.in_start..self.in_end];
            let Some(&[outer_type, _, _, len_hi, len_lo]) = available.get(..HEADER) else {
                return Ok(());
            };
            let sealed_len = usize::from(u16::from_be_bytes([len_hi, len_lo]));
            let tag_len = self.rx.tag_len();
            if outer_type != APPLICATION_DATA {
                return Err(invalid(format!(
                    "unexpected record type {outer_type} after the handshake"
                )));
            }
            if sealed_len > MAX_CIPHERTEXT || sealed_len < 1 + tag_len {
                return Err(invalid(format!("record of {sealed_len} bytes")));
            }
            if available.len() < HEADER + sealed_len {
                return Ok(());
            }
            let header = [outer_type, 3, 3, len_hi, len_lo];
            let start = self.in_start + HEADER;
            let (ciphertext, tag) =
                self.input[start..start + sealed_len].split_at(sealed_len - tag_len);
            let opened_len = ciphertext.len();
            // TLSInnerPlaintext, padding included, is at most 2^14 + 1 bytes (RFC 8446 §5.4).
            if opened_len > MAX_PLAIN + 1 {
                return Err(invalid("record_overflow"));
            }
            let nonce = self.rx.next_nonce()?;
            let direct = buf.remaining() >= opened_len;
            let opened: &mut [u8] = if direct {
                buf.initialize_unfilled_to(opened_len)
            } else {
                &mut self.spill[..opened_len]
            };
            self.rx
                .key
                .open_separate_gather(nonce, Aad::from(header), ciphertext, tag, opened)
                .map_err(|_| invalid("a record failed authentication (bad_record_mac)"))?;
            self.in_start += HEADER + sealed_len;
            // The content type is the last non-zero byte; zeros after it are padding.
            let Some(type_at) = opened.iter().rposition(|&b| b != 0) else {
                return Err(invalid("a record without a content type"));
            };
            if type_at > MAX_PLAIN {
                return Err(invalid("record_overflow"));
            }
            let content_type = opened[type_at];
            // A handshake message split across records admits no other record in between, and
            // handshake records are never empty (RFC 8446 §5.1).
            if !self.handshake.is_empty() && content_type != HANDSHAKE {
                return Err(invalid(
                    "a handshake message interleaved with other records",
                ));
            }
            if content_type == HANDSHAKE && type_at == 0 {
                return Err(invalid("an empty handshake record"));
            }
            if content_type == APPLICATION_DATA {
                if direct {
                    buf.advance(type_at);
                } else {
                    self.spill_start = 0;
                    self.spill_end = type_at;
                    self.read_spill(buf);
                }
                continue;
            }
            let content = opened[..type_at].to_vec();
            match content_type {
                ALERT => self.alert(&content)?,
                HANDSHAKE => self.handshake_message(&content)?,
                other => return Err(invalid(format!("unexpected content type {other}"))),
            }
        }
        Ok(())
    }

    fn read_spill(&mut self, buf: &mut ReadBuf<'_>) {
        let n = buf.remaining().min(self.spill_end - self.spill_start);
        buf.put_slice(&self.spill[self.spill_start..self.spill_start + n]);
        self.spill_start += n;
        if self.spill_start == self.spill_end {
            self.spill_start = 0;
            self.spill_end = 0;
        }
    }

    fn alert(&mut self, content: &[u8]) -> io::Result<()> {
        match content {
            [_, CLOSE_NOTIFY] => {
                self.peer_closed = true;
                Ok(())
            }
            // Announces a close_notify (RFC 8446 §6.1); every other alert is an error.
            [_, USER_CANCELED] => Ok(()),
            [_, description] => Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                format!(
                    "peer sent TLS alert {:?}",
                    rustls::AlertDescription::from(*description)
                ),
            )),
            _ => Err(invalid("malformed alert")),
        }
    }

    fn handshake_message(&mut self, content: &[u8]) -> io::Result<()> {
        self.handshake.extend_from_slice(content);
        while let Some(&[kind, a, b, c]) = self.handshake.get(..4) {
            let len = u32::from_be_bytes([0, a, b, c]) as usize;
            if len > MAX_HANDSHAKE_MESSAGE {
                return Err(invalid("oversized handshake message"));
            }
            let Some(body) = self.handshake.get(4..4 + len) else {
                break;
            };
            match (kind, body) {
                (KEY_UPDATE, &[request]) if request <= 1 => {
                    // A key update ends its record (RFC 8446 §5.1): nothing may follow it.
                    if self.handshake.len() != 4 + len {
                        return Err(invalid("data after a key update in its record"));
                    }
                    let next = self.updates.next_rx().map_err(tls_error)?;
                    self.rx = Direction::new(0, next)?;
                    self.update_requested |= request == 1;
                }
                (KEY_UPDATE, _) => return Err(invalid("malformed key update")),
                // Link servers send no tickets, and link clients do not resume.
                (NEW_SESSION_TICKET, _) => {}
                (other, _) => {
                    return Err(invalid(format!(
                        "unexpected handshake message {other} after the handshake"
                    )));
                }
            }
            self.handshake.drain(..4 + len);
        }
        if self.handshake.len() > MAX_HANDSHAKE_MESSAGE {
            return Err(invalid("oversized handshake message"));
        }
        Ok(())
    }
}

impl<IO: AsyncWrite + Unpin> RecordStream<IO> {
    /// Writes the sealed records until none are left.
    fn poll_write_out(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.out_start < self.out_end {
            let n = ready!(
                Pin::new(&mut self.io).poll_write(cx, &self.output[self.out_start..self.out_end])
            )?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.out_start += n;
        }
        self.out_start = 0;
        self.out_end = 0;
        Poll::Ready(Ok(()))
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for RecordStream<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Some((kind, message)) = &this.failed {
            return Poll::Ready(Err(io::Error::new(*kind, message.clone())));
        }
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        loop {
            if this.spill_start < this.spill_end {
                this.read_spill(buf);
                return Poll::Ready(Ok(()));
            }
            let before = buf.filled().len();
            if let Err(e) = this.open_records(buf) {
                // Data opened before the bad record is read first; the error comes next time.
                this.failed = Some((e.kind(), e.to_string()));
                if buf.filled().len() == before {
                    return Poll::Ready(Err(e));
                }
            }
            if buf.filled().len() > before || this.peer_closed {
                return Poll::Ready(Ok(()));
            }
            // Keep the incomplete record (smaller than a read) and leave room for a whole read
            // after it.
            if this.in_start == this.in_end {
                this.in_start = 0;
                this.in_end = 0;
            } else if this.input.len() - this.in_end < IN_CAPACITY {
                this.input.copy_within(this.in_start..this.in_end, 0);
                this.in_end -= this.in_start;
                this.in_start = 0;
            }
            let read_end = (this.in_end + IN_CAPACITY).min(this.input.len());
            let mut read = ReadBuf::new(&mut this.input[this.in_end..read_end]);
            ready!(Pin::new(&mut this.io).poll_read(cx, &mut read))?;
            let n = read.filled().len();
            if n == 0 {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "peer closed the connection without a TLS close_notify",
                )));
            }
            this.in_end += n;
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for RecordStream<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.close_sent {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        if this.room() < SEAL_ROOM {
            ready!(this.poll_write_out(cx))?;
        }
        Poll::Ready(this.seal_slices(bufs))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_write_out(cx))?;
        Pin::new(&mut this.io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.close_sent {
            if this.room() < SEAL_ROOM {
                ready!(this.poll_write_out(cx))?;
            }
            // close_notify, level warning (RFC 8446 §6.1).
            this.seal(ALERT, &[1, CLOSE_NOTIFY])?;
            this.close_sent = true;
        }
        ready!(this.poll_write_out(cx))?;
        Pin::new(&mut this.io).poll_shutdown(cx)
    }
}

fn invalid(message: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message.into())
}

fn tls_error(e: rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

#[cfg(test)]
mod tests {
    //! Each side of the record layer against rustls's own (tokio-rustls) over real sockets:
    //! what one seals the other must open, key updates included.
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use k8s_openapi::api::core::v1::Secret;
    use keyway_core::tls::TlsMaterial;
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    use rustls::pki_types::ServerName;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    use crate::handshake;

    const ALPN: &[u8] = crate::ALPN_FORWARD;

    /// Two sites' link material, issued by one CA.
    fn pki() -> (TlsMaterial, TlsMaterial) {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca =
            CertifiedIssuer::self_signed(params, KeyPair::generate().expect("key")).expect("ca");
        let site = |name: &str| {
            let key = KeyPair::generate().expect("key");
            let cert = CertificateParams::new(vec![name.to_string()])
                .expect("params")
                .signed_by(&key, &ca)
                .expect("cert");
            let secret = Secret {
                string_data: Some(BTreeMap::from([
                    ("tls.crt".to_string(), cert.pem()),
                    ("tls.key".to_string(), key.serialize_pem()),
                    ("ca.crt".to_string(), ca.pem()),
                ])),
                ..Default::default()
            };
            keyway_core::tls::material_from_secret(&secret, true).expect("material")
        };
        (site("a.test"), site("b.test"))
    }

    fn server_config(m: &TlsMaterial) -> Arc<rustls::ServerConfig> {
        keyway_dataplane::tls::access_server_config(m, &[ALPN], false).expect("server config")
    }

    fn client_config(m: &TlsMaterial) -> Arc<rustls::ClientConfig> {
        keyway_dataplane::tls::link_client_config(m, ALPN).expect("client config")
    }

    fn name() -> ServerName<'static> {
        ServerName::try_from("b.test").expect("name")
    }

    async fn tcp_pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (client, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        (client.expect("connect"), accepted.expect("accept").0)
    }

    /// `len` bytes that differ from one offset to the next, so a lost or reordered record shows.
    fn payload(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|i| (i % 251) as u8 ^ seed).collect()
    }

    /// Writes `data` in pieces of many sizes: single bytes and small slices (gathered into
    /// records), vectored writes of a header and a large body (as HTTP/2 does), whole records.
    async fn write_in_pieces(w: &mut (impl tokio::io::AsyncWrite + Unpin), data: &[u8]) {
        let mut at = 0;
        let sizes = [1, 9, 300, 16_384, 70_000, 5, 1_000_000];
        for size in sizes.iter().cycle() {
            if at == data.len() {
                break;
            }
            let end = (at + size).min(data.len());
            if *size == 70_000 && end - at > 9 {
                let (head, body) = data[at..end].split_at(9);
                let mut bufs = [std::io::IoSlice::new(head), std::io::IoSlice::new(body)];
                let mut slices = &mut bufs[..];
                let mut left = end - at;
                while left > 0 {
                    let n = w.write_vectored(slices).await.expect("write_vectored");
                    left -= n;
                    std::io::IoSlice::advance_slices(&mut slices, n);
                }
            } else {
                w.write_all(&data[at..end]).await.expect("write");
            }
            at = end;
        }
        w.flush().await.expect("flush");
    }

    /// Our client against a rustls server: data both ways, each side's close_notify ending the
    /// other's reading cleanly. `update_after`: records between our key updates.
    async fn ours_as_client(update_after: Option<u64>) {
        let (a, b) = pki();
        let (client_tcp, server_tcp) = tcp_pair().await;
        let acceptor = tokio_rustls::TlsAcceptor::from(server_config(&b));
        let up = payload(3 << 20, 1);
        let down = payload(2 << 20, 2);
        let (up2, down2) = (up.clone(), down.clone());
        let server = tokio::spawn(async move {
            let mut tls = acceptor.accept(server_tcp).await.expect("rustls accept");
            let mut got = Vec::new();
            tls.read_to_end(&mut got).await.expect("rustls read");
            assert!(
                got == up2,
                "rustls read {} bytes, not what was sent",
                got.len()
            );
            write_in_pieces(&mut tls, &down2).await;
            tls.shutdown().await.expect("rustls shutdown");
        });
        let established = handshake::connect(client_config(&a), name(), client_tcp)
            .await
            .expect("our handshake");
        assert_eq!(established.alpn.as_deref(), Some(ALPN));
        assert!(established.authenticated);
        let mut ours = established.stream;
        if let Some(n) = update_after {
            ours.set_update_after(n);
        }
        write_in_pieces(&mut ours, &up).await;
        ours.shutdown().await.expect("our shutdown");
        let mut got = Vec::new();
        ours.read_to_end(&mut got).await.expect("our read");
        assert!(
            got == down,
            "we read {} bytes, not what was sent",
            got.len()
        );
        server.await.expect("server");
    }

    #[tokio::test]
    async fn our_records_and_rustls_records_interoperate_as_client() {
        ours_as_client(None).await;
    }

    #[tokio::test]
    async fn our_key_updates_are_followed_by_rustls() {
        // Every third record under a new key: ~60 key updates in 3 MiB.
        ours_as_client(Some(3)).await;
    }

    /// Our server against a rustls client that refreshes its keys and asks for ours (a
    /// KeyUpdate with update_requested) in the middle of the data.
    #[tokio::test]
    async fn our_records_and_rustls_records_interoperate_as_server() {
        let (a, b) = pki();
        let (client_tcp, server_tcp) = tcp_pair().await;
        let connector = tokio_rustls::TlsConnector::from(client_config(&a));
        let up = payload(3 << 20, 3);
        let down = payload(2 << 20, 4);
        let (up2, down2) = (up.clone(), down.clone());
        let client = tokio::spawn(async move {
            let mut tls = connector
                .connect(name(), client_tcp)
                .await
                .expect("rustls connect");
            write_in_pieces(&mut tls, &up2[..1 << 20]).await;
            tls.get_mut().1.refresh_traffic_keys().expect("refresh");
            write_in_pieces(&mut tls, &up2[1 << 20..]).await;
            let mut got = Vec::new();
            tls.read_to_end(&mut got).await.expect("rustls read");
            assert!(
                got == down2,
                "rustls read {} bytes, not what was sent",
                got.len()
            );
            tls.shutdown().await.expect("rustls shutdown");
        });
        let established = handshake::accept(server_config(&b), server_tcp)
            .await
            .expect("our handshake");
        assert_eq!(established.alpn.as_deref(), Some(ALPN));
        assert!(established.authenticated);
        let mut ours = established.stream;
        let mut got = vec![0u8; up.len()];
        ours.read_exact(&mut got).await.expect("our read");
        assert!(got == up, "we read other bytes than were sent");
        assert!(
            ours.update_requested,
            "the peer's key update request was not seen"
        );
        write_in_pieces(&mut ours, &down).await;
        ours.shutdown().await.expect("our shutdown");
        let mut rest = Vec::new();
        ours.read_to_end(&mut rest).await.expect("close_notify");
        assert!(rest.is_empty());
        client.await.expect("client");
    }

    /// Traffic keys for an in-memory pair: generation `n` of direction `base` is `[base + n; 32]`.
    struct Generations {
        tx: (u8, u8),
        rx: (u8, u8),
    }

    fn secrets(base: u8) -> rustls::ConnectionTrafficSecrets {
        rustls::ConnectionTrafficSecrets::Aes256Gcm {
            key: rustls::crypto::cipher::AeadKey::from([base; 32]),
            iv: rustls::crypto::cipher::Iv::from([base; 12]),
        }
    }

    impl super::KeyUpdates for Generations {
        fn next_tx(&mut self) -> Result<rustls::ConnectionTrafficSecrets, rustls::Error> {
            self.tx.1 += 1;
            Ok(secrets(self.tx.0 + self.tx.1))
        }
        fn next_rx(&mut self) -> Result<rustls::ConnectionTrafficSecrets, rustls::Error> {
            self.rx.1 += 1;
            Ok(secrets(self.rx.0 + self.rx.1))
        }
    }

    /// A record stream over `io` whose keys derive from `tx` and `rx`.
    fn record_stream<IO>(io: IO, tx: u8, rx: u8) -> super::RecordStream<IO> {
        let extracted = rustls::ExtractedSecrets {
            tx: (0, secrets(tx)),
            rx: (0, secrets(rx)),
        };
        let updates = Box::new(Generations {
            tx: (tx, 0),
            rx: (rx, 0),
        });
        super::RecordStream::new(io, extracted, updates, 1 << 24, &[], Vec::new())
            .expect("record stream")
    }

    /// Two record streams joined in memory, `a` sealing with `b`'s receiving keys.
    fn pair() -> (
        super::RecordStream<tokio::io::DuplexStream>,
        super::RecordStream<tokio::io::DuplexStream>,
    ) {
        let (x, y) = tokio::io::duplex(1 << 20);
        (record_stream(x, 10, 100), record_stream(y, 100, 10))
    }

    /// A socket that hands over the bytes it holds in pieces of the given sizes, in turn.
    struct Pieces {
        data: Vec<u8>,
        at: usize,
        sizes: &'static [usize],
        turn: usize,
    }

    impl tokio::io::AsyncRead for Pieces {
        fn poll_read(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            let size = self.sizes[self.turn % self.sizes.len()];
            let n = size.min(buf.remaining()).min(self.data.len() - self.at);
            buf.put_slice(&self.data[self.at..self.at + n]);
            self.at += n;
            self.turn += 1;
            std::task::Poll::Ready(Ok(()))
        }
    }

    /// The incoming buffer keeps an incomplete record across reads and moves it to the front
    /// only when its tail is short: however the socket splits several MiB of records (single
    /// bytes, a header's worth, a record and a bit, many records at once), every byte is read
    /// once and in order.
    #[tokio::test]
    async fn records_split_across_reads_of_any_size() {
        let (x, mut sealed_end) = tokio::io::duplex(8 << 20);
        let data = payload(3 << 20, 5);
        let mut a = record_stream(x, 10, 100);
        write_in_pieces(&mut a, &data).await;
        a.shutdown().await.expect("shutdown");
        let mut sealed = Vec::new();
        sealed_end
            .read_to_end(&mut sealed)
            .await
            .expect("sealed records");
        let splits: [&'static [usize]; 4] = [
            &[1, 5, 16_406, 40_000],
            &[32 << 10],
            &[100_000, 3, 16_407],
            &[7, 1 << 20],
        ];
        for sizes in splits {
            let socket = Pieces {
                data: sealed.clone(),
                at: 0,
                sizes,
                turn: 0,
            };
            let mut b = record_stream(socket, 100, 10);
            let mut got = Vec::new();
            b.read_to_end(&mut got).await.expect("read");
            assert!(got == data, "reads of {sizes:?}");
        }
    }

    /// Records of every content type a peer could seal, and what the reader makes of them:
    /// the data it reads, then the error it reports (or none: a clean end).
    #[tokio::test]
    async fn content_types_after_the_handshake() {
        use super::{ALERT, APPLICATION_DATA, HANDSHAKE};
        type Records = &'static [(u8, &'static [u8])];
        /// "x" as data, padded with zeros to `N` bytes; sealed as type 0, the inner plaintext
        /// is `N + 1` bytes, its last byte padding too.
        const fn padded<const N: usize>() -> [u8; N] {
            let mut p = [0u8; N];
            p[0] = b'x';
            p[1] = APPLICATION_DATA;
            p
        }
        static LONGEST: [u8; super::MAX_PLAIN] = padded();
        static TOO_LONG: [u8; super::MAX_PLAIN + 1] = padded();
        static PADDED_OK: [(u8, &[u8]); 2] = [(0, &LONGEST), (ALERT, &[1, 0])];
        static PADDED_TOO_LONG: [(u8, &[u8]); 1] = [(0, &TOO_LONG)];
        let cases: [(&str, Records, &[u8], Option<&str>); 14] = [
            (
                "padding up to 2^14 + 1 bytes of inner plaintext",
                &PADDED_OK,
                b"x",
                None,
            ),
            (
                "padding past 2^14 + 1 bytes of inner plaintext",
                &PADDED_TOO_LONG,
                b"",
                Some("record_overflow"),
            ),
            (
                "data, then close_notify: the rest is ignored",
                &[
                    (APPLICATION_DATA, b"hello"),
                    (ALERT, &[1, 0]),
                    (APPLICATION_DATA, b"late"),
                ],
                b"hello",
                None,
            ),
            (
                "a fatal alert",
                &[(APPLICATION_DATA, b"x"), (ALERT, &[2, 40])],
                b"x",
                Some("HandshakeFailure"),
            ),
            (
                "user_canceled, then close_notify",
                &[
                    (APPLICATION_DATA, b"a"),
                    (ALERT, &[1, 90]),
                    (APPLICATION_DATA, b"b"),
                    (ALERT, &[1, 0]),
                ],
                b"ab",
                None,
            ),
            (
                "a malformed alert",
                &[(ALERT, &[2])],
                b"",
                Some("malformed alert"),
            ),
            (
                "a key update its sender did not follow: the next record fails",
                &[
                    (HANDSHAKE, &[24, 0, 0, 1, 0]),
                    (APPLICATION_DATA, b"old key"),
                ],
                b"",
                Some("failed authentication"),
            ),
            (
                "a session ticket is ignored",
                &[
                    (HANDSHAKE, &[4, 0, 0, 2, 9, 9]),
                    (APPLICATION_DATA, b"after"),
                    (ALERT, &[1, 0]),
                ],
                b"after",
                None,
            ),
            (
                "a key update of the wrong length",
                &[(HANDSHAKE, &[24, 0, 0, 2, 0, 0])],
                b"",
                Some("malformed key update"),
            ),
            (
                "a key update with more after it",
                &[(HANDSHAKE, &[24, 0, 0, 1, 0, 4, 0, 0, 0])],
                b"",
                Some("data after a key update"),
            ),
            (
                "a ClientHello after the handshake",
                &[(HANDSHAKE, &[1, 0, 0, 1, 0])],
                b"",
                Some("unexpected handshake message 1"),
            ),
            (
                "a handshake message split by data",
                &[(HANDSHAKE, &[24, 0, 0]), (APPLICATION_DATA, b"x")],
                b"",
                Some("interleaved"),
            ),
            (
                "an empty handshake record",
                &[(HANDSHAKE, &[])],
                b"",
                Some("empty handshake"),
            ),
            (
                "an unknown content type",
                &[(99, b"?")],
                b"",
                Some("content type 99"),
            ),
        ];
        for (what, records, data, error) in cases {
            let (mut a, mut b) = pair();
            for (content_type, content) in records {
                a.seal_one(*content_type, content).expect("seal");
            }
            a.flush().await.expect("flush");
            drop(a);
            let mut got = Vec::new();
            let result = b.read_to_end(&mut got).await;
            match error {
                None => assert!(result.is_ok(), "{what}: {result:?}"),
                Some(e) => {
                    let err = result.expect_err(what);
                    assert!(err.to_string().contains(e), "{what}: {e:?} not in {err}");
                }
            }
            assert_eq!(got, data, "{what}");
        }
    }

    /// Both directions of an in-memory pair, with `a` replacing its key every record.
    #[tokio::test]
    async fn key_updates_every_record_in_memory() {
        let (mut a, mut b) = pair();
        a.set_update_after(1);
        let data = payload(300_000, 7);
        let sent = data.clone();
        let writer = tokio::spawn(async move {
            write_in_pieces(&mut a, &sent).await;
            a.shutdown().await.expect("shutdown");
        });
        let mut got = Vec::new();
        b.read_to_end(&mut got).await.expect("read");
        assert!(got == data);
        writer.await.expect("writer");
    }

    /// Bytes a peer writes on the socket after the handshake, outside TLS, and what reading
    /// them must say: an error, never data and never a panic.
    #[tokio::test]
    async fn forged_and_malformed_records_are_refused() {
        let mut forged = vec![23, 3, 3, 0, 40];
        forged.extend(payload(40, 9));
        let cases: [(Vec<u8>, &str); 5] = [
            (forged, "bad_record_mac"),
            (
                vec![22, 3, 3, 0, 5, 1, 2, 3, 4, 5],
                "unexpected record type 22",
            ),
            (vec![23, 3, 3, 0xff, 0xff], "record of 65535 bytes"),
            (vec![23, 3, 3, 0, 3, 1, 2, 3], "record of 3 bytes"),
            (vec![23, 3, 3, 0, 40, 1, 2], "without a TLS close_notify"),
        ];
        let (a, b) = pki();
        for (bytes, expected) in cases {
            let (client_tcp, server_tcp) = tcp_pair().await;
            let acceptor = tokio_rustls::TlsAcceptor::from(server_config(&b));
            let server = tokio::spawn(async move {
                let tls = acceptor.accept(server_tcp).await.expect("rustls accept");
                let (mut tcp, _) = tls.into_inner();
                tcp.write_all(&bytes).await.expect("write");
                tcp.shutdown().await.expect("shutdown");
            });
            let mut ours = handshake::connect(client_config(&a), name(), client_tcp)
                .await
                .expect("our handshake")
                .stream;
            let mut got = Vec::new();
            let err = ours
                .read_to_end(&mut got)
                .await
                .expect_err("forged bytes read as data");
            assert!(got.is_empty());
            assert!(
                err.to_string().contains(expected),
                "{expected:?} not in {err}"
            );
            server.await.expect("server");
        }
    }
}
