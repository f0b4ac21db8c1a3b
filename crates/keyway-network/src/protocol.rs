//! The control protocol (docs/protocol.md): newline-delimited JSON messages on one long-lived
//! HTTP/2 stream per link connection. The dialing side's messages travel in the request body,
//! the accepting side's in the response body.
//!
//! Every message is checked before it is used: unknown types, bad JSON, messages over
//! [`MAX_MESSAGE`] bytes and messages out of order (anything before `hello`, a second `hello`)
//! are errors that close the connection; nothing here panics on peer input.

use bytes::{Bytes, BytesMut};
use serde::{Deserialize, Serialize};

/// The protocol version this build speaks.
pub const VERSION: u32 = 1;
/// Largest control message, newline excluded: room for an advertisement of some 60,000
/// routing keys of the longest kind (or several times more of usual length).
pub const MAX_MESSAGE: usize = 16 * 1024 * 1024;
/// Longest site name or routing key accepted from a peer.
pub const MAX_NAME: usize = 253;
/// Most keys or links one advertisement may carry.
pub const MAX_ITEMS: usize = 65_536;
/// Largest first message (a `hello`, a few hundred bytes): nothing bigger is read before the
/// peer has said who it is.
pub const MAX_HELLO: usize = 4 * 1024;

/// One control message. Written as serde's internally tagged enum; read by [`Message::parse`].
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "camelCase")]
pub enum Message {
    /// First message each way: who the site is, and the cost of this link (the dialer's Link
    /// cost, which the accepting side adopts; the accepting side sends 0).
    Hello {
        version: u32,
        site: String,
        id: String,
        cost: u64,
    },
    /// Sent every second; proves the control loop of the peer is alive.
    Keepalive,
    /// From the dialing side: the Link's cost was edited; the connection stays and both ends
    /// use the new cost from now on.
    Cost { cost: u64 },
    /// This connection is being replaced (its Link's certificate was rotated): open no new
    /// streams on it. The streams it carries go on; the dialer closes it when they are done.
    Retire,
    /// A site's link-state advertisement, flooded to every site.
    Advertisement(Advertisement),
}

/// What one site can reach and whom it is linked to. Newer `seq` replaces older.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Advertisement {
    pub origin: String,
    pub id: String,
    pub seq: u64,
    /// Routing keys with a healthy target at the origin.
    #[serde(default, deserialize_with = "at_most_max_items")]
    pub keys: Vec<String>,
    /// Routing keys some listener at the origin uses.
    #[serde(default, deserialize_with = "at_most_max_items")]
    pub listening: Vec<String>,
    /// Sites the origin can open streams to, with the link cost.
    #[serde(default, deserialize_with = "at_most_max_items")]
    pub links: Vec<Adjacency>,
    /// The origin is shutting down (it advertises no keys and no links meanwhile). A site of
    /// the same name that it kept out takes its name back at once, rather than after its wait;
    /// the empty lists alone would not say this, as a site that has just started sends them too.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub draining: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Adjacency {
    pub site: String,
    pub cost: u64,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ProtocolError {
    #[error("control message larger than {MAX_MESSAGE} bytes")]
    Oversized,
    #[error("malformed control message: {0}")]
    Malformed(String),
    #[error("unsupported protocol version {0} (this site speaks {VERSION})")]
    Version(u32),
    #[error("{0} before hello")]
    BeforeHello(&'static str),
    #[error("second hello on one connection")]
    SecondHello,
    #[error("invalid {what}: {why}")]
    Invalid { what: &'static str, why: String },
}

/// A list of at most [`MAX_ITEMS`], refused as soon as it grows past that rather than once read
/// whole: a peer's line of 16 MiB could otherwise hold millions of entries.
fn at_most_max_items<'de, D, T>(d: D) -> Result<Vec<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    struct Bounded<T>(std::marker::PhantomData<T>);
    impl<'de, T: Deserialize<'de>> serde::de::Visitor<'de> for Bounded<T> {
        type Value = Vec<T>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "a list of at most {MAX_ITEMS} entries")
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
            let mut out = Vec::new();
            while let Some(item) = seq.next_element()? {
                if out.len() == MAX_ITEMS {
                    return Err(serde::de::Error::custom(format_args!(
                        "more than {MAX_ITEMS} entries"
                    )));
                }
                out.push(item);
            }
            Ok(out)
        }
    }
    d.deserialize_seq(Bounded(std::marker::PhantomData))
}

/// A message's `type`, read first: the message is then read as that type's fields straight
/// from the line. (serde's internally tagged enums copy the whole line into a tree of values
/// first, unknown fields included: ~20 bytes of memory for each byte of a list of small
/// values.)
#[derive(Deserialize)]
struct Tag<'a> {
    #[serde(rename = "type", borrow)]
    kind: std::borrow::Cow<'a, str>,
}

#[derive(Deserialize)]
struct HelloFields {
    version: u32,
    site: String,
    id: String,
    cost: u64,
}

#[derive(Deserialize)]
struct CostFields {
    cost: u64,
}

impl Message {
    /// One line of JSON as a message (fields of other types are ignored, as an internally
    /// tagged enum would).
    pub fn parse(line: &[u8]) -> Result<Message, serde_json::Error> {
        let tag: Tag = serde_json::from_slice(line)?;
        Ok(match tag.kind.as_ref() {
            "hello" => {
                let HelloFields {
                    version,
                    site,
                    id,
                    cost,
                } = serde_json::from_slice(line)?;
                Message::Hello {
                    version,
                    site,
                    id,
                    cost,
                }
            }
            "keepalive" => Message::Keepalive,
            "cost" => Message::Cost {
                cost: serde_json::from_slice::<CostFields>(line)?.cost,
            },
            "retire" => Message::Retire,
            "advertisement" => Message::Advertisement(serde_json::from_slice(line)?),
            other => {
                return Err(serde::de::Error::unknown_variant(
                    other,
                    &["hello", "keepalive", "cost", "retire", "advertisement"],
                ));
            }
        })
    }

    /// The message as one line of JSON.
    pub fn encode(&self) -> Bytes {
        let mut v = serde_json::to_vec(self).unwrap_or_default();
        v.push(b'\n');
        Bytes::from(v)
    }

    fn kind(&self) -> &'static str {
        match self {
            Message::Hello { .. } => "hello",
            Message::Keepalive => "keepalive",
            Message::Cost { .. } => "cost",
            Message::Retire => "retire",
            Message::Advertisement(_) => "advertisement",
        }
    }
}

fn check_name(what: &'static str, name: &str) -> Result<(), ProtocolError> {
    if name.is_empty() || name.len() > MAX_NAME || name.chars().any(char::is_control) {
        return Err(ProtocolError::Invalid {
            what,
            why: format!("`{}`", name.escape_debug()),
        });
    }
    Ok(())
}

/// Checks the fields of a parsed message (sizes, names).
pub fn validate(msg: &Message) -> Result<(), ProtocolError> {
    match msg {
        Message::Hello { site, id, .. } => {
            check_name("site name", site)?;
            check_name("site id", id)
        }
        Message::Keepalive | Message::Cost { .. } | Message::Retire => Ok(()),
        Message::Advertisement(a) => {
            check_name("site name", &a.origin)?;
            check_name("site id", &a.id)?;
            // (The lists' lengths were bounded as they were read: `at_most_max_items`.)
            for k in a.keys.iter().chain(&a.listening) {
                check_name("routing key", k)?;
            }
            for l in &a.links {
                check_name("site name", &l.site)?;
            }
            Ok(())
        }
    }
}

/// A routing key or site name as a stream header value: header values are visible ASCII, names
/// need not be (`café`), so every other byte, and `%` itself, is written `%XX`.
pub fn header_encode(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for &b in name.as_bytes() {
        if b.is_ascii_graphic() && b != b'%' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The name a [`header_encode`]d value stands for; `None` if it is not one: only the encoding
/// [`header_encode`] writes (`%` and two uppercase hex digits) is read, and the name must be
/// one a peer may send (see [`check_name`]).
pub fn header_decode(value: &str) -> Option<String> {
    fn hex(d: u8) -> Option<u8> {
        match d {
            b'0'..=b'9' => Some(d - b'0'),
            b'A'..=b'F' => Some(d - b'A' + 10),
            _ => None,
        }
    }
    let mut bytes = Vec::with_capacity(value.len());
    let mut rest = value.as_bytes();
    while let [b, tail @ ..] = rest {
        if *b == b'%' {
            let [h, l, tail @ ..] = tail else {
                return None;
            };
            bytes.push(hex(*h)? << 4 | hex(*l)?);
            rest = tail;
        } else {
            bytes.push(*b);
            rest = tail;
        }
    }
    let name = String::from_utf8(bytes).ok()?;
    check_name("name", &name).ok()?;
    Some(name)
}

/// Splits a byte stream into messages and enforces their order.
#[derive(Default)]
pub struct Decoder {
    buf: BytesMut,
    /// How much of `buf` is known to hold no newline: each byte is looked at once, however
    /// finely the peer splits its messages (a line sent a byte per frame would otherwise cost
    /// time quadratic in its length).
    scanned: usize,
    hello_seen: bool,
}

impl Decoder {
    /// Adds received bytes; fails at once when a line grows past the limit.
    pub fn push(&mut self, data: &[u8]) -> Result<(), ProtocolError> {
        self.buf.extend_from_slice(data);
        if self.newline().is_none() && self.buf.len() > self.limit() {
            return Err(ProtocolError::Oversized);
        }
        Ok(())
    }

    /// The longest line allowed now: [`MAX_HELLO`] until the peer's `hello`.
    fn limit(&self) -> usize {
        match self.hello_seen {
            true => MAX_MESSAGE,
            false => MAX_HELLO,
        }
    }

    /// Where the first newline in `buf` is, scanning only bytes not scanned before.
    fn newline(&mut self) -> Option<usize> {
        match self.buf[self.scanned..].iter().position(|b| *b == b'\n') {
            Some(i) => Some(self.scanned + i),
            None => {
                self.scanned = self.buf.len();
                None
            }
        }
    }

    /// The next complete message, if any.
    pub fn next_message(&mut self) -> Result<Option<Message>, ProtocolError> {
        let Some(end) = self.newline() else {
            return Ok(None);
        };
        self.scanned = 0;
        let line = self.buf.split_to(end + 1);
        let line = &line[..end];
        if line.len() > self.limit() {
            return Err(ProtocolError::Oversized);
        }
        let msg = Message::parse(line).map_err(|e| ProtocolError::Malformed(e.to_string()))?;
        validate(&msg)?;
        match (&msg, self.hello_seen) {
            (Message::Hello { version, .. }, false) => {
                if *version != VERSION {
                    return Err(ProtocolError::Version(*version));
                }
                self.hello_seen = true;
            }
            (Message::Hello { .. }, true) => return Err(ProtocolError::SecondHello),
            (other, false) => return Err(ProtocolError::BeforeHello(other.kind())),
            _ => {}
        }
        Ok(Some(msg))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello() -> Message {
        Message::Hello {
            version: VERSION,
            site: "a".into(),
            id: "1".into(),
            cost: 1,
        }
    }

    #[test]
    fn round_trip_and_order() {
        let mut d = Decoder::default();
        let mut wire = hello().encode().to_vec();
        wire.extend_from_slice(&Message::Keepalive.encode());
        wire.extend_from_slice(&Message::Cost { cost: 3 }.encode());
        wire.extend_from_slice(&Message::Retire.encode());
        // Split mid-message: the decoder waits for the newline.
        d.push(&wire[..5]).unwrap();
        assert_eq!(d.next_message().unwrap(), None);
        d.push(&wire[5..]).unwrap();
        assert_eq!(d.next_message().unwrap(), Some(hello()));
        assert_eq!(d.next_message().unwrap(), Some(Message::Keepalive));
        assert_eq!(d.next_message().unwrap(), Some(Message::Cost { cost: 3 }));
        assert_eq!(d.next_message().unwrap(), Some(Message::Retire));
        assert_eq!(&Message::Retire.encode()[..], b"{\"type\":\"retire\"}\n");
        d.push(&hello().encode()).unwrap();
        assert_eq!(d.next_message(), Err(ProtocolError::SecondHello));
    }

    /// A peer may send its control stream one byte per HTTP/2 DATA frame (h2 hands each frame
    /// to `read_some` as one chunk). Each `push` scans the whole pending buffer for a newline,
    /// so a line of n bytes costs O(n^2): a 1 MiB line (the allowed maximum) sent a byte at a
    /// time is ~5*10^11 byte comparisons, pinning a runtime thread for minutes. Decoding must
    /// stay linear in the bytes received.
    #[test]
    fn byte_at_a_time_line_is_decoded_in_linear_time() {
        let line_len = 32 * 1024;
        let mut d = Decoder::default();
        d.push(&hello().encode()).unwrap();
        assert_eq!(d.next_message().unwrap(), Some(hello()));
        let start = std::time::Instant::now();
        for _ in 0..line_len {
            d.push(b" ").unwrap();
            assert_eq!(d.next_message().unwrap(), None);
        }
        let elapsed = start.elapsed();
        // Linear work on 32 KiB is well under a millisecond per KiB, even unoptimised.
        assert!(
            elapsed < std::time::Duration::from_millis(200),
            "32 KiB sent one byte at a time took {elapsed:?} to buffer (quadratic scan)"
        );
    }

    /// `draining` is optional both ways: left out when false (what version-1 sites before it
    /// sent), and read as false when absent.
    #[test]
    fn the_draining_flag_is_optional() {
        let line = br#"{"type":"advertisement","origin":"west","id":"9f","seq":7,"keys":["db"]}"#;
        let Ok(Message::Advertisement(adv)) = Message::parse(line) else {
            panic!("an advertisement without the flag");
        };
        assert!(!adv.draining);
        let encoded = Message::Advertisement(adv.clone()).encode();
        assert!(!String::from_utf8_lossy(&encoded).contains("draining"));
        let draining = Advertisement {
            draining: true,
            ..adv
        };
        let encoded = Message::Advertisement(draining.clone()).encode();
        assert!(String::from_utf8_lossy(&encoded).contains(r#""draining":true"#));
        let back = Message::parse(&encoded[..encoded.len() - 1]).expect("decodes");
        assert_eq!(back, Message::Advertisement(draining));
    }

    #[test]
    fn header_values_carry_any_name() {
        for name in ["plain-key", "café", "a%b", "with space", "ключ/v1"] {
            let v = header_encode(name);
            assert!(v.bytes().all(|b| b.is_ascii_graphic()), "{v}");
            assert_eq!(header_decode(&v).as_deref(), Some(name));
        }
        assert_eq!(header_encode("café"), "caf%C3%A9");
        // Only what header_encode writes: uppercase hex, no sign, and a name a peer may send.
        for bad in [
            "%",
            "%4",
            "%zz",
            "%FF",
            "%+1",
            "caf%c3%a9",
            "",
            "%0A",
            "a%00b",
        ] {
            assert_eq!(header_decode(bad), None, "{bad}");
        }
    }

    /// A line costs memory in proportion to what it carries, however it is made up: unknown
    /// fields are skipped, not copied into a tree of values, and a list is refused once it has
    /// more than MAX_ITEMS entries (each entry a String would cost ~40 bytes for its 4).
    #[test]
    fn big_lines_are_refused_as_they_are_read() {
        let mut d = Decoder::default();
        d.push(&hello().encode()).unwrap();
        assert_eq!(d.next_message().unwrap(), Some(hello()));
        let mut line =
            br#"{"type":"advertisement","origin":"w","id":"1","seq":1,"keys":["#.to_vec();
        line.extend(std::iter::repeat_n(&b"\"a\","[..], MAX_ITEMS + 1).flatten());
        line.extend_from_slice(b"\"a\"]}\n");
        d.push(&line).unwrap();
        let Err(ProtocolError::Malformed(why)) = d.next_message() else {
            panic!("a list past MAX_ITEMS is refused");
        };
        assert!(why.contains("more than 65536 entries"), "{why}");
        // Fields of no message are skipped whatever they hold; the message is read.
        let mut d = Decoder::default();
        d.push(&hello().encode()).unwrap();
        d.next_message().unwrap();
        let junk = format!(
            "{{\"type\":\"cost\",\"junk\":[{}0],\"cost\":4}}\n",
            "[0,{}],".repeat(1000)
        );
        d.push(junk.as_bytes()).unwrap();
        assert_eq!(d.next_message(), Ok(Some(Message::Cost { cost: 4 })));
    }

    /// Before the peer's hello, a line longer than a hello can be is refused at once.
    #[test]
    fn the_first_line_is_short() {
        let mut d = Decoder::default();
        assert_eq!(
            d.push(&vec![b' '; MAX_HELLO + 1]),
            Err(ProtocolError::Oversized)
        );
        let mut d = Decoder::default();
        let mut keepalive = br#"{"type":"keepalive","junk":""#.to_vec();
        keepalive.extend(std::iter::repeat_n(b'x', MAX_HELLO));
        keepalive.extend_from_slice(b"\"}\n");
        d.push(&keepalive).unwrap();
        assert_eq!(d.next_message(), Err(ProtocolError::Oversized));
    }

    #[test]
    fn rejects_bad_input() {
        let mut d = Decoder::default();
        d.push(&Message::Keepalive.encode()).unwrap();
        assert_eq!(
            d.next_message(),
            Err(ProtocolError::BeforeHello("keepalive"))
        );

        let mut d = Decoder::default();
        d.push(b"\x16\x03\x01garbage\n").unwrap();
        assert!(matches!(d.next_message(), Err(ProtocolError::Malformed(_))));

        let mut d = Decoder::default();
        d.push(br#"{"type":"hello","version":99,"site":"a","id":"1","cost":1}"#)
            .unwrap();
        d.push(b"\n").unwrap();
        assert_eq!(d.next_message(), Err(ProtocolError::Version(99)));

        let mut d = Decoder::default();
        d.push(&hello().encode()).unwrap();
        d.next_message().unwrap();
        assert_eq!(
            d.push(&vec![b'x'; MAX_MESSAGE + 1]),
            Err(ProtocolError::Oversized)
        );

        let mut d = Decoder::default();
        d.push(b"{\"type\":\"nonsense\"}\n").unwrap();
        let Err(ProtocolError::Malformed(why)) = d.next_message() else {
            panic!("an unknown type is refused");
        };
        assert!(why.contains("unknown variant `nonsense`"), "{why}");

        let mut d = Decoder::default();
        d.push(br#"{"type":"hello","version":1,"site":"","id":"1","cost":1}"#)
            .unwrap();
        d.push(b"\n").unwrap();
        assert!(matches!(
            d.next_message(),
            Err(ProtocolError::Invalid { .. })
        ));
    }
}
