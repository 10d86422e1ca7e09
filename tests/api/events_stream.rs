//! The live event stream (`GET /events/stream`): the feed of `GET /events` as
//! Server-Sent Events.
//!
//! Invariants protected here: a stream delivers each event as it is recorded, as
//! `id: <cursor>`, `event: <type>`, `data: <the event's JSON>`, the data and the order
//! those of the feed; an event's `id` is the feed cursor right after it, so that a
//! reconnection with `Last-Event-ID` (which wins over `?after=`) or `?after=` continues
//! with exactly the events after it, those made while disconnected included, no loss and
//! no repeat; an idle stream gets a keep-alive comment every 15 s; a reader that lets
//! 256 events wait is disconnected with a final comment saying so, and resumes from its
//! last id with exactly the rest; at most `MAX_EVENT_STREAMS` streams are open at once
//! (one more is a 503 `too_many_streams` with `Retry-After`), and a closed stream's place
//! is free again; a reader that stops reading gives its place back once a write to it has
//! waited the server's limit; a cursor or a type the stream cannot read is a 400, never a
//! 500, and a forged cursor is a 400 saying why; a cursor whose next events the retention
//! removed is a 410 at connect; a shutdown ends every stream with a final comment and
//! closes its connection, and a process with readers that stopped reading still exits
//! within a bound after SIGTERM; with API keys a read-only key may follow the stream, no
//! key may not.
//!
//! The recorder is asynchronous and a follower reads the feed a few times a second:
//! tests wait for events (with a deadline), never for a fixed time, except for the
//! keep-alive, whose period is the behaviour.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use mongodb::bson::{Document, doc};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use transfer_service::config::parse_api_keys;

use crate::assert_problem;
use support::{TestApp, eventually, spawn_app, spawn_app_with};

/// How long the recorder may take to record an event (a few hundred ms as a rule).
const RECORDED_WITHIN: Duration = Duration::from_secs(10);
/// How long a stream may take to deliver an event once it happened: the recorder's
/// delay plus the follower's (a signal every 100 ms, a read at least every 2 s).
const DELIVERED_WITHIN: Duration = Duration::from_secs(10);
const POLL_EVERY: Duration = Duration::from_millis(25);
/// What the final comment of a reader too slow to keep up starts with.
const FELL_BEHIND: &str = "disconnected: this reader fell 256 events behind";
/// What the final comment of a stream ended by a shutdown starts with.
const SHUTTING_DOWN: &str = "disconnected: the server is shutting down";

// ---------------------------------------------------------------------------------
// Reading a stream.

/// One frame of a stream, parsed.
#[derive(Debug, Clone)]
enum Frame {
    Event(StreamEvent),
    /// A comment (`: <text>`), without its `: `.
    Comment(String),
}

/// An event as a stream sends it.
#[derive(Debug, Clone)]
struct StreamEvent {
    /// The `id:` line: the feed cursor right after this event.
    cursor: String,
    /// The `event:` line.
    kind: String,
    /// The `data:` line, parsed.
    data: Value,
}

impl StreamEvent {
    /// The event's own id (`<type>:<subject>`), from its data.
    fn id(&self) -> String {
        event_id(&self.data)
    }
}

/// Parses one frame (its lines, without the blank line that ends it). An event must
/// have exactly one `id:`, `event:` and `data:` line, and nothing else; `event` must be
/// the data's `type`.
fn parse_frame(block: &str) -> Frame {
    let lines: Vec<&str> = block.split('\n').collect();
    if lines.iter().all(|l| l.starts_with(':')) {
        let text: Vec<&str> = lines
            .iter()
            .map(|l| l.strip_prefix(": ").unwrap_or(&l[1..]))
            .collect();
        return Frame::Comment(text.join("\n"));
    }
    let (mut id, mut kind, mut data) = (None, None, None);
    for line in &lines {
        let (field, value) = line
            .split_once(": ")
            .unwrap_or_else(|| panic!("a field line is `name: value`: {line:?} in {block:?}"));
        let slot = match field {
            "id" => &mut id,
            "event" => &mut kind,
            "data" => &mut data,
            _ => panic!("unexpected field {field:?} in {block:?}"),
        };
        assert!(slot.is_none(), "{field} twice in {block:?}");
        *slot = Some(value.to_owned());
    }
    let (Some(cursor), Some(kind), Some(data)) = (id, kind, data) else {
        panic!("an event frame has id, event and data: {block:?}");
    };
    assert!(!cursor.is_empty(), "an empty id: {block:?}");
    let data: Value =
        serde_json::from_str(&data).unwrap_or_else(|e| panic!("the data is JSON ({e}): {block:?}"));
    assert_eq!(
        data["type"].as_str(),
        Some(kind.as_str()),
        "`event` is the data's type: {block:?}"
    );
    Frame::Event(StreamEvent { cursor, kind, data })
}

/// The frames of `bytes` (a stream's body from its start), and what is left after the
/// last complete one.
fn parse_frames(bytes: &[u8]) -> (Vec<Frame>, &[u8]) {
    let mut frames = Vec::new();
    let mut rest = bytes;
    while let Some(end) = find(rest, b"\n\n") {
        let block = std::str::from_utf8(&rest[..end]).expect("a frame is UTF-8");
        frames.push(parse_frame(block));
        rest = &rest[end + 2..];
    }
    (frames, rest)
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// A stream opened with reqwest, read frame by frame.
struct SseStream {
    response: reqwest::Response,
    buffer: Vec<u8>,
    ended: bool,
}

impl SseStream {
    /// The next frame, or `None` once the body has ended (after a complete frame).
    ///
    /// # Panics
    /// If no frame comes by `deadline`.
    async fn next_frame_by(&mut self, deadline: Instant) -> Option<Frame> {
        loop {
            if let Some(end) = find(&self.buffer, b"\n\n") {
                let block: Vec<u8> = self.buffer.drain(..end + 2).collect();
                let text = std::str::from_utf8(&block[..end]).expect("a frame is UTF-8");
                return Some(parse_frame(text));
            }
            if self.ended {
                assert!(
                    self.buffer.is_empty(),
                    "the stream ended in the middle of a frame: {:?}",
                    String::from_utf8_lossy(&self.buffer)
                );
                return None;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.response.chunk()).await {
                Err(_) => panic!(
                    "no complete frame in time; received so far: {:?}",
                    String::from_utf8_lossy(&self.buffer)
                ),
                Ok(Ok(Some(bytes))) => self.buffer.extend_from_slice(&bytes),
                Ok(Ok(None)) => self.ended = true,
                Ok(Err(e)) => panic!("reading the stream failed: {e}"),
            }
        }
    }

    async fn next_frame(&mut self, within: Duration) -> Option<Frame> {
        self.next_frame_by(Instant::now() + within).await
    }

    /// The next `n` events, within `within` in all, skipping keep-alive comments.
    ///
    /// # Panics
    /// At any other comment, or the end of the stream, before `n` events.
    async fn events(&mut self, n: usize, within: Duration) -> Vec<StreamEvent> {
        let deadline = Instant::now() + within;
        let mut events = Vec::with_capacity(n);
        while events.len() < n {
            match self.next_frame_by(deadline).await {
                Some(Frame::Event(event)) => events.push(event),
                Some(Frame::Comment(c)) if c == "keep-alive" => {}
                other => panic!(
                    "after {} of {n} events: {other:?}; those: {:?}",
                    events.len(),
                    events.iter().map(StreamEvent::id).collect::<Vec<_>>()
                ),
            }
        }
        events
    }

    /// The next event.
    async fn event(&mut self) -> StreamEvent {
        self.events(1, DELIVERED_WITHIN).await.remove(0)
    }
}

/// `GET /events/stream{query}`, with `Last-Event-ID` when given, and `Authorization:
/// Bearer` when given.
async fn connect(
    app: &TestApp,
    query: &str,
    last_event_id: Option<&str>,
    key: Option<&str>,
) -> reqwest::Response {
    let mut request = app.http.get(app.url(&format!("/events/stream{query}")));
    if let Some(id) = last_event_id {
        request = request.header("last-event-id", id);
    }
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    request.send().await.expect("request")
}

/// Asserts that the answer is a stream: 200, `text/event-stream`.
fn as_stream(response: reqwest::Response, what: &str) -> SseStream {
    assert_eq!(response.status(), 200, "{what}");
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    assert!(
        content_type.starts_with("text/event-stream"),
        "{what}: content type {content_type:?}"
    );
    SseStream {
        response,
        buffer: Vec::new(),
        ended: false,
    }
}

/// Opens a stream, asserted 200 `text/event-stream`.
async fn open_stream(app: &TestApp, query: &str, last_event_id: Option<&str>) -> SseStream {
    let what = format!("GET /events/stream{query} (Last-Event-ID: {last_event_id:?})");
    as_stream(connect(app, query, last_event_id, None).await, &what)
}

// ---------------------------------------------------------------------------------
// A stream read over a raw connection, for a reader that does not read, and to see the
// connection itself close.

/// Opens a TCP connection to the app (with this receive buffer when given: set before
/// connecting, so that the window the client offers stays that small, and then with
/// [`SMALL_SEGMENT`]) and sends `GET path` on it, with `Connection: close` when `close`.
async fn raw_request(
    app: &TestApp,
    path: &str,
    recv_buffer: Option<u32>,
    close: bool,
) -> TcpStream {
    raw_request_to(&app.address, path, recv_buffer, close).await
}

/// [`raw_request`] to the service at `base` (`http://host:port`).
async fn raw_request_to(
    base: &str,
    path: &str,
    recv_buffer: Option<u32>,
    close: bool,
) -> TcpStream {
    let addr: SocketAddr = base
        .trim_start_matches("http://")
        .parse()
        .expect("the service's address");
    let socket = TcpSocket::new_v4().expect("a socket");
    if let Some(size) = recv_buffer {
        socket.set_recv_buffer_size(size).expect("SO_RCVBUF");
        small_segments(&socket);
    }
    let mut stream = socket.connect(addr).await.expect("connect");
    let connection = if close { "Connection: close\r\n" } else { "" };
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: text/event-stream\r\n{connection}\r\n"
    );
    stream
        .write_all(request.as_bytes())
        .await
        .expect("send the request");
    stream
}

/// The segment size a reader with a small receive buffer announces (TCP_MAXSEG, before
/// connecting). The kernel sizes the server's send buffer from the segment size (on the
/// loopback, 65,483 bytes a segment): with it, a reader that reads nothing held some
/// 240 KB of events in the buffers and the queue before the server's writes waited,
/// against 2.9 MB without it (measured: 524 against 6,247 openings), so that a test
/// fills them with a twelfth of the events. (Measured before the server capped its send
/// buffers, `SEND_BUFFER`: a burst of some 500 large events written at once, a round of
/// the recorder, once grew one to the whole 1.9 MB of [`FILLS_A_READER`].)
const SMALL_SEGMENT: i32 = 536;

/// Sets [`SMALL_SEGMENT`] on `socket`.
fn small_segments(socket: &TcpSocket) {
    use std::os::fd::AsRawFd;
    // SAFETY: setsockopt(2) on a socket this function borrows, with a pointer to an i32
    // that lives across the call and its size.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_MAXSEG,
            (&SMALL_SEGMENT as *const i32).cast(),
            std::mem::size_of::<i32>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "TCP_MAXSEG: {}", std::io::Error::last_os_error());
}

/// Reads the response's head, a little at a time; the head and what came after it.
async fn read_head(stream: &mut TcpStream) -> (String, Vec<u8>) {
    let mut got = Vec::new();
    let mut buf = [0u8; 256];
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(end) = find(&got, b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&got[..end]).into_owned();
            return (head, got[end + 4..].to_vec());
        }
        let left = deadline.saturating_duration_since(Instant::now());
        let n = tokio::time::timeout(left, stream.read(&mut buf))
            .await
            .expect("the response's head in time")
            .expect("read");
        assert!(
            n > 0,
            "closed before the head: {:?}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
}

/// Reads until the server closes the connection; everything read. What the server wrote
/// before it closed may take a while to drain through a small receive window (a socket
/// closed with data in its send buffer sends it all first), so the bound is on quiet:
/// a connection that is open with nothing to send is quiet.
///
/// # Panics
/// If the connection gives neither a byte nor its end for `quiet`.
async fn read_until_closed(stream: &mut TcpStream, quiet: Duration) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match tokio::time::timeout(quiet, stream.read(&mut buf)).await {
            Err(_) => panic!(
                "the connection was open and quiet for {quiet:?}; {} bytes read, ending {:?}",
                got.len(),
                String::from_utf8_lossy(&got[got.len().saturating_sub(300)..])
            ),
            Ok(Ok(n)) => n,
            Ok(Err(e)) => panic!("reading the connection failed: {e}"),
        };
        if n == 0 {
            return got;
        }
        got.extend_from_slice(&buf[..n]);
    }
}

/// Decodes a chunked body; the body, and whether its last chunk (`0`) was there.
fn dechunk(mut raw: &[u8]) -> (Vec<u8>, bool) {
    let mut body = Vec::new();
    loop {
        let Some(line_end) = find(raw, b"\r\n") else {
            return (body, false);
        };
        let size_text = std::str::from_utf8(&raw[..line_end]).expect("a chunk size line");
        let size_text = size_text.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_text, 16)
            .unwrap_or_else(|e| panic!("a chunk size ({e}): {size_text:?}"));
        raw = &raw[line_end + 2..];
        if size == 0 {
            return (body, true);
        }
        if raw.len() < size + 2 {
            body.extend_from_slice(&raw[..raw.len().min(size)]);
            return (body, false);
        }
        body.extend_from_slice(&raw[..size]);
        assert_eq!(&raw[size..size + 2], b"\r\n", "a chunk ends with CRLF");
        raw = &raw[size + 2..];
    }
}

/// The head of a stream's answer must be a 200 `text/event-stream`, chunked.
fn assert_stream_head(head: &str) {
    let lower = head.to_ascii_lowercase();
    assert!(lower.starts_with("http/1.1 200"), "{head}");
    assert!(lower.contains("content-type: text/event-stream"), "{head}");
    assert!(lower.contains("transfer-encoding: chunked"), "{head}");
}

/// The last non-empty line of `body`.
fn last_line(body: &[u8]) -> String {
    String::from_utf8_lossy(body)
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or_default()
        .to_owned()
}

// ---------------------------------------------------------------------------------
// The feed, and making events.

fn event_id(event: &Value) -> String {
    event["id"]
        .as_str()
        .unwrap_or_else(|| panic!("an event has an id: {event}"))
        .to_owned()
}

fn ids(events: &[Value]) -> Vec<String> {
    events.iter().map(event_id).collect()
}

fn stream_ids(events: &[StreamEvent]) -> Vec<String> {
    events.iter().map(StreamEvent::id).collect()
}

fn stream_data(events: &[StreamEvent]) -> Vec<Value> {
    events.iter().map(|e| e.data.clone()).collect()
}

/// `GET /events{query}`, asserted 200; its items and `next`.
async fn events_page(app: &TestApp, query: &str) -> (Vec<Value>, String) {
    let path = format!("/events{query}");
    let (status, page) = crate::get_json(app, &path).await;
    assert_eq!(status, 200, "GET {path}: {page}");
    let items = page["items"].as_array().expect("items").clone();
    let next = page["next"].as_str().expect("next").to_owned();
    (items, next)
}

/// Opens `barrier` and reads the feed, following `next`, until its event is there: the
/// recorder records in the order of the changes, so every event made before it is there
/// too. The whole feed then.
async fn whole_feed(app: &TestApp, barrier: &str) -> Vec<Value> {
    whole_feed_within(app, barrier, RECORDED_WITHIN).await
}

/// [`whole_feed`], the barrier recorded within `within`.
async fn whole_feed_within(app: &TestApp, barrier: &str, within: Duration) -> Vec<Value> {
    open(app, barrier, 0).await;
    let wanted = format!("account.opened:{barrier}");
    let deadline = Instant::now() + within;
    let mut events: Vec<Value> = Vec::new();
    let mut query = "?limit=1000".to_owned();
    loop {
        let (items, next) = events_page(app, &query).await;
        let empty = items.is_empty();
        let found = ids(&items).contains(&wanted);
        events.extend(items);
        query = format!("?limit=1000&after={next}");
        if found {
            return events;
        }
        if empty {
            assert!(
                Instant::now() < deadline,
                "{wanted} is not recorded in time"
            );
            tokio::time::sleep(POLL_EVERY).await;
        }
    }
}

/// Opens an account, asserted 201.
async fn open(app: &TestApp, id: &str, balance: i64) {
    let response = app
        .post_json("/accounts", json!({ "id": id, "balance": balance }))
        .await;
    let status = response.status();
    let body = response.text().await.expect("a body");
    assert_eq!(status, 201, "opening {id}: {body}");
}

fn id_of(transfer: &Value) -> String {
    transfer["id"]
        .as_str()
        .unwrap_or_else(|| panic!("a transfer has an id: {transfer}"))
        .to_owned()
}

/// A transfer asserted done; its event's id.
async fn done(app: &TestApp, source: &str, destination: &str, amount: i64) -> String {
    let (status, body) = app.transfer(source, destination, amount).await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["state"], "done", "{body}");
    format!("transfer.done:{}", id_of(&body))
}

/// A transfer asserted refused for insufficient funds; its event's id.
async fn refused(app: &TestApp, source: &str, destination: &str, amount: i64) -> String {
    let (status, body) = app.transfer(source, destination, amount).await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["code"], "insufficient_funds", "{body}");
    format!(
        "transfer.canceled:{}",
        body["transferId"].as_str().expect("a transferId")
    )
}

/// A hold for a minute, asserted held; its id.
async fn hold(app: &TestApp, source: &str, destination: &str, amount: i64) -> String {
    let response = app
        .post_json(
            "/transfers",
            json!({
                "source": source, "destination": destination, "amount": amount,
                "hold": { "expiresInMs": 60_000 },
            }),
        )
        .await;
    let status = response.status();
    let body: Value = response.json().await.expect("a JSON body");
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["state"], "held", "{body}");
    id_of(&body)
}

/// `POST /transfers/{id}/{action}`, asserted 200.
async fn hold_action(app: &TestApp, id: &str, action: &str) {
    let response = app
        .http
        .post(app.url(&format!("/transfers/{id}/{action}")))
        .send()
        .await
        .expect("request");
    let status = response.status();
    let text = response.text().await.expect("a body");
    assert_eq!(status, 200, "{action} {id}: {text}");
}

/// Reads the next events of `stream`, asserted to be `wanted` (their ids), in order.
async fn expect(stream: &mut SseStream, wanted: &[String]) -> Vec<StreamEvent> {
    let got = stream.events(wanted.len(), DELIVERED_WITHIN).await;
    assert_eq!(
        stream_ids(&got),
        wanted,
        "the stream delivers the events made"
    );
    got
}

/// Makes `n` transfers of 1 from `source` to `destination`; their events' ids.
async fn transfers(app: &TestApp, source: &str, destination: &str, n: usize) -> Vec<String> {
    let mut made = Vec::new();
    for _ in 0..n {
        made.push(done(app, source, destination, 1).await);
    }
    made
}

// ---------------------------------------------------------------------------------
// The tests.

#[tokio::test]
async fn a_stream_opened_before_any_event_receives_each_event_as_it_happens_as_the_feed_has_it() {
    let app = spawn_app().await;
    let mut all = open_stream(&app, "", None).await;
    let mut ended = open_stream(&app, "?type=transfer.done,transfer.canceled", None).await;

    // Each step's events reach the stream before the next step is made.
    let mut received: Vec<StreamEvent> = Vec::new();
    open(&app, "alice", 1_000).await;
    received.extend(expect(&mut all, &["account.opened:alice".to_owned()]).await);
    open(&app, "bob", 0).await;
    received.extend(expect(&mut all, &["account.opened:bob".to_owned()]).await);
    let plain = done(&app, "alice", "bob", 100).await;
    received.extend(expect(&mut all, &[plain]).await);
    let refusal = refused(&app, "bob", "alice", 1_000).await;
    received.extend(expect(&mut all, &[refusal]).await);
    let voided = hold(&app, "alice", "bob", 50).await;
    received.extend(expect(&mut all, &[format!("transfer.held:{voided}")]).await);
    hold_action(&app, &voided, "void").await;
    received.extend(expect(&mut all, &[format!("transfer.canceled:{voided}")]).await);
    let captured = hold(&app, "alice", "bob", 30).await;
    hold_action(&app, &captured, "capture").await;
    let both = [
        format!("transfer.held:{captured}"),
        format!("transfer.done:{captured}"),
    ];
    received.extend(expect(&mut all, &both).await);
    let back = done(&app, "bob", "alice", 1).await;
    received.extend(expect(&mut all, &[back]).await);

    let (feed, _) = events_page(&app, "?limit=1000").await;
    assert_eq!(
        ids(&feed),
        stream_ids(&received),
        "the feed holds the same events"
    );
    assert_eq!(
        stream_data(&received),
        feed,
        "each event's data is the feed's, in the feed's order"
    );
    for event in &received {
        assert_eq!(event.kind, event.data["type"], "{event:?}");
    }
    // Each id is the feed cursor right after its event.
    for (i, event) in received.iter().enumerate() {
        let (after, _) = events_page(&app, &format!("?limit=1000&after={}", event.cursor)).await;
        assert_eq!(
            after,
            feed[i + 1..],
            "the id of event {i} ({}) is the cursor right after it",
            event.id()
        );
    }

    // The filtered stream: those types only, in the feed's order.
    let wanted: Vec<Value> = feed
        .iter()
        .filter(|e| ["transfer.done", "transfer.canceled"].contains(&e["type"].as_str().unwrap()))
        .cloned()
        .collect();
    let got = ended.events(wanted.len(), DELIVERED_WITHIN).await;
    assert_eq!(
        stream_data(&got),
        wanted,
        "type=transfer.done,transfer.canceled"
    );

    // Nothing more on either: the next event each gets is the next one made.
    open(&app, "carol", 0).await;
    let next = done(&app, "alice", "carol", 5).await;
    assert_eq!(all.event().await.id(), "account.opened:carol");
    assert_eq!(all.event().await.id(), next);
    assert_eq!(ended.event().await.id(), next);
}

#[tokio::test]
async fn a_stream_resumed_from_an_event_id_continues_with_exactly_the_events_after_it() {
    let app = spawn_app().await;
    open(&app, "alice", 1_000).await;
    open(&app, "bob", 0).await;
    transfers(&app, "alice", "bob", 5).await;
    let before = whole_feed(&app, "barrier-1").await;
    assert_eq!(before.len(), 8);

    let mut first = open_stream(&app, "", None).await;
    let received = first.events(before.len(), DELIVERED_WITHIN).await;
    assert_eq!(stream_data(&received), before);
    let mut first_filtered = open_stream(&app, "?type=transfer.done", None).await;
    let received_filtered = first_filtered.events(5, DELIVERED_WITHIN).await;
    drop(first);
    drop(first_filtered);

    // Made while no stream is open.
    let mut while_away = transfers(&app, "bob", "alice", 2).await;
    while_away.push(refused(&app, "bob", "alice", 1_000_000).await);
    let feed = whole_feed(&app, "barrier-2").await;
    assert_eq!(feed[..before.len()], before[..]);
    assert_eq!(ids(&feed[before.len()..feed.len() - 1]), while_away);

    // (stream, events it must give first, what)
    let mut resumed: Vec<(SseStream, Vec<Value>, String)> = Vec::new();
    let last = received.len() - 1;
    for k in [0, 1, 4, last] {
        let id = &received[k].cursor;
        let stream = open_stream(&app, "", Some(id)).await;
        resumed.push((
            stream,
            feed[k + 1..].to_vec(),
            format!("Last-Event-ID of event {k}"),
        ));
    }
    // A feed page's next, as ?after=, is the same as the id of the page's last event.
    let (page, next) = events_page(&app, "?limit=5").await;
    assert_eq!(page, feed[..5]);
    let stream = open_stream(&app, &format!("?after={next}"), None).await;
    resumed.push((stream, feed[5..].to_vec(), "?after= a page's next".into()));
    let stream = open_stream(&app, &format!("?after={}", received[4].cursor), None).await;
    resumed.push((
        stream,
        feed[5..].to_vec(),
        "?after= the id of event 4".into(),
    ));
    // Both given: the header wins.
    let (_, after_two) = events_page(&app, "?limit=2").await;
    let stream = open_stream(
        &app,
        &format!("?after={after_two}"),
        Some(&received[5].cursor),
    )
    .await;
    resumed.push((
        stream,
        feed[6..].to_vec(),
        "Last-Event-ID of event 5 with ?after= of event 1".into(),
    ));
    // A filtered stream resumed: the done transfers after the one it last got.
    let stream = open_stream(
        &app,
        "?type=transfer.done",
        Some(&received_filtered[1].cursor),
    )
    .await;
    let done_after: Vec<Value> = feed
        .iter()
        .filter(|e| e["type"] == "transfer.done")
        .skip(2)
        .cloned()
        .collect();
    resumed.push((
        stream,
        done_after,
        "type=transfer.done, Last-Event-ID".into(),
    ));

    let mut at_the_end = None;
    for (stream, wanted, what) in &mut resumed {
        let got = stream.events(wanted.len(), DELIVERED_WITHIN).await;
        assert_eq!(stream_data(&got), *wanted, "{what}");
        if at_the_end.is_none() {
            // The first: every event after the first one, so its last is the feed's.
            at_the_end = got.last().map(|e| e.cursor.clone());
        }
    }
    // From the id of the very last event: nothing yet.
    let stream = open_stream(&app, "", at_the_end.as_deref()).await;
    resumed.push((stream, Vec::new(), "Last-Event-ID of the last event".into()));

    // No stream has anything more than it was given: the next event each gets is the
    // next one made.
    open(&app, "barrier-3", 0).await;
    let next = done(&app, "alice", "barrier-3", 1).await;
    for (stream, _, what) in &mut resumed {
        let got = stream.event().await.id();
        let wanted = if what.starts_with("type=") {
            next.clone()
        } else {
            "account.opened:barrier-3".to_owned()
        };
        assert_eq!(got, wanted, "{what}: no repeat, nothing extra");
    }
}

#[tokio::test]
async fn an_idle_stream_gets_a_keep_alive_comment_every_15_s() {
    let app = spawn_app().await;
    let mut stream = open_stream(&app, "", None).await;
    let opened = Instant::now();
    let frame = stream.next_frame(Duration::from_secs(17)).await;
    let waited = opened.elapsed();
    match frame {
        Some(Frame::Comment(text)) => assert_eq!(text, "keep-alive"),
        other => panic!("an idle stream's first frame: {other:?}"),
    }
    assert!(
        waited >= Duration::from_secs(14),
        "the keep-alive comes every 15 s, not after {waited:?}"
    );
    // Still open: an event made now arrives.
    open(&app, "alice", 0).await;
    assert_eq!(stream.event().await.id(), "account.opened:alice");
}

/// Reads `n` events from the stream resumed after `cursor` and, should the reader
/// itself fall behind (it parses every event; the follower sends a page of 100 at a
/// time), from the last id it got, as a browser's `EventSource` would; the events, the
/// stream still open, and how many times it had to reconnect.
async fn read_resuming(
    app: &TestApp,
    cursor: &str,
    n: usize,
) -> (Vec<StreamEvent>, SseStream, usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut events: Vec<StreamEvent> = Vec::new();
    let mut reconnections = 0;
    let mut from = cursor.to_owned();
    'connection: loop {
        let mut stream = open_stream(app, "", Some(&from)).await;
        while events.len() < n {
            match stream.next_frame_by(deadline).await {
                Some(Frame::Event(event)) => events.push(event),
                Some(Frame::Comment(c)) if c == "keep-alive" => {}
                Some(Frame::Comment(c)) if c.starts_with("disconnected: this reader fell") => {
                    assert!(
                        stream.next_frame_by(deadline).await.is_none(),
                        "{c}: the end"
                    );
                    from = events.last().map_or(from, |e| e.cursor.clone());
                    reconnections += 1;
                    assert!(reconnections < 100, "the reader keeps falling behind");
                    continue 'connection;
                }
                other => panic!("after {} of {n} events: {other:?}", events.len()),
            }
        }
        return (events, stream, reconnections);
    }
}

/// A reader that opens a stream and reads nothing while thousands of events happen lets
/// its 256-event queue fill: the server ends its stream with a final comment and closes
/// the connection; the reader then resumes from the last id it got, with exactly the
/// rest.
#[tokio::test]
async fn a_reader_that_falls_256_events_behind_is_disconnected_and_resumes_with_exactly_the_rest() {
    /// Accounts inserted straight into the database, each an `account.opened` event:
    /// some six times what the connection's buffers and the queue held (524 events with
    /// the reader's small segments, see [`SMALL_SEGMENT`]; 6,000 without them).
    const INSERTED: usize = 3_000;
    const BATCH: usize = 1_000;
    // A reader that reads nothing until the end: the server's limit on a write that waits
    // (HTTP_WRITE_TIMEOUT_MS, which would close it) set well beyond what the test takes.
    let app = spawn_app_with(|s| s.http_write_timeout = Duration::from_secs(600)).await;
    open(&app, "template", 0).await;
    let accounts = app.store.database().collection::<Document>("accounts");
    let template = accounts
        .find_one(doc! { "_id": "template" })
        .await
        .unwrap()
        .expect("the account opened");

    // A reader with a small receive buffer that reads the answer's head, then nothing.
    let mut slow = raw_request(&app, "/events/stream", Some(4096), true).await;
    let (head, mut raw) = read_head(&mut slow).await;
    assert_stream_head(&head);

    for batch in 0..INSERTED / BATCH {
        let docs: Vec<Document> = (0..BATCH)
            .map(|i| {
                let mut account = template.clone();
                account.insert("_id", format!("bulk-{:05}", batch * BATCH + i));
                account
            })
            .collect();
        accounts
            .insert_many(docs)
            .await
            .expect("insert the accounts");
    }
    // The recorder records a few thousand events a second.
    let feed = whole_feed_within(&app, "barrier", Duration::from_secs(60)).await;
    assert_eq!(
        feed.len(),
        INSERTED + 2,
        "the template, the accounts, the barrier"
    );

    // The slow reader's follower has followed the recorder all along (it is signalled
    // within 100 ms of each new event, and reads pages back to back while they are
    // full), so it overtook what the connection's buffers hold long before the last
    // event was recorded. Now read everything, until the server closes.
    raw.extend(read_until_closed(&mut slow, Duration::from_secs(10)).await);
    let (body, complete) = dechunk(&raw);
    assert!(complete, "the body ends with its last chunk");
    let (frames, rest) = parse_frames(&body);
    assert!(rest.is_empty(), "the body ends with a complete frame");
    assert_eq!(
        last_line(&body),
        format!(": {FELL_BEHIND}; reconnect with Last-Event-ID"),
        "the last line says why"
    );
    let (last, events) = frames.split_last().expect("frames");
    assert!(
        matches!(last, Frame::Comment(c) if c.starts_with(FELL_BEHIND)),
        "{last:?}"
    );
    let got: Vec<StreamEvent> = events
        .iter()
        .filter_map(|f| match f {
            Frame::Event(e) => Some(e.clone()),
            Frame::Comment(c) if c == "keep-alive" => None,
            Frame::Comment(c) => panic!("a comment before the end: {c}"),
        })
        .collect();
    assert!(
        got.len() < INSERTED,
        "a reader that fell behind has not got everything: {} of {} (if the kernel's \
         buffers hold them all, make more events)",
        got.len(),
        feed.len()
    );
    assert_eq!(
        stream_data(&got),
        feed[..got.len()],
        "what it got, it got in order"
    );

    // Resumed from its last id: exactly the rest, then only what comes next.
    let resumed_from = got.last().expect("some events").cursor.clone();
    let (rest, mut resumed, reconnections) =
        read_resuming(&app, &resumed_from, feed.len() - got.len()).await;
    assert_eq!(
        stream_ids(&rest),
        ids(&feed[got.len()..]),
        "resumed ({reconnections} reconnections): the events it missed, none twice"
    );
    assert_eq!(stream_data(&rest), feed[got.len()..]);
    open(&app, "after", 0).await;
    assert_eq!(resumed.event().await.id(), "account.opened:after");
}

/// A transfer of 16 legs between 64-character account ids, made through the service at
/// `base`: its `transfer.done` event is some 3 KB of JSON on a stream. Its stored
/// document, to be copied.
async fn large_transfer(
    http: &reqwest::Client,
    base: &str,
    database: &mongodb::Database,
) -> Document {
    let name = |i: usize| format!("{i:x>64}");
    for (i, balance) in (0..16).map(|i| (i, 0)).chain([(99, 1_000_000)]) {
        let opened = http
            .post(format!("{base}/accounts"))
            .json(&json!({ "id": name(i), "balance": balance }))
            .send()
            .await
            .expect("open an account");
        assert_eq!(opened.status(), 201);
    }
    let legs: Vec<Value> = (0..16)
        .map(|i| json!({ "source": name(99), "destination": name(i), "amount": 1 }))
        .collect();
    let response = http
        .post(format!("{base}/transfers"))
        .json(&json!({ "legs": legs }))
        .send()
        .await
        .expect("the transfer");
    assert_eq!(response.status(), 201);
    let transfer: Value = response.json().await.unwrap();
    let id = mongodb::bson::oid::ObjectId::parse_str(transfer["id"].as_str().unwrap()).unwrap();
    let mut template = database
        .collection::<Document>("transactions")
        .find_one(doc! { "_id": id })
        .await
        .unwrap()
        .expect("the transfer logged");
    for field in ["idempotencyKey", "requestHash"] {
        template.remove(field);
    }
    template
}

/// Inserts `n` copies of the transfer `template` (each its own id) into `database`: a
/// `transfer.done` event each, marked due as the service's own write marks it.
async fn flood(database: &mongodb::Database, template: &Document, n: usize) {
    let transactions = database.collection::<Document>("transactions");
    let docs: Vec<Document> = (0..n)
        .map(|_| {
            let mut copy = template.clone();
            copy.insert("_id", mongodb::bson::oid::ObjectId::new());
            let due = doc! { "type": "transfer.done", "at": mongodb::bson::DateTime::now() };
            copy.insert("eventsDue", vec![due]);
            copy
        })
        .collect();
    for batch in docs.chunks(500) {
        transactions
            .insert_many(batch.to_vec())
            .await
            .expect("insert the transfers");
    }
}

/// Copies of [`large_transfer`] that fill the buffers of a reader that reads nothing, with
/// a small receive buffer and small segments: some 1.8 MB of stream, three times what
/// the connection's buffers (some 240 KB) and the follower's queue (512 KiB) take before
/// its writes wait.
const FILLS_A_READER: usize = 600;

/// A reader of the stream at `base` that reads the answer's head and then nothing, with
/// a small receive buffer: once the events sent to it fill the kernel's buffers, the
/// server's writes to it wait.
async fn stalled_reader(base: &str) -> TcpStream {
    let mut reader = raw_request_to(base, "/events/stream", Some(4096), false).await;
    let (head, _) = read_head(&mut reader).await;
    assert_stream_head(&head);
    reader
}

/// Readers that stop reading hold their stream's place only until a write to them has
/// waited the server's limit (`HTTP_WRITE_TIMEOUT_MS`, 3 s here): then their connections
/// are closed, and new streams are served. Before, they held their places for ever and
/// every new stream was refused 503.
#[tokio::test]
async fn readers_that_stop_reading_give_their_stream_places_back() {
    /// The server's limit and what filling the readers' buffers takes after the feed is
    /// whole (it is done by then as a rule), with room for a loaded machine.
    const SERVED_WITHIN: Duration = Duration::from_secs(60);
    let app = spawn_app_with(|s| {
        s.max_event_streams = 3;
        s.http_write_timeout = Duration::from_secs(3);
    })
    .await;
    let template = large_transfer(&app.http, &app.address, app.store.database()).await;
    let mut stalled = Vec::new();
    for _ in 0..3 {
        stalled.push(stalled_reader(&app.address).await);
    }
    assert_problem(connect(&app, "", None, None).await, 503, "too_many_streams").await;

    flood(app.store.database(), &template, FILLS_A_READER).await;
    let feed = whole_feed_within(&app, "barrier", Duration::from_secs(60)).await;
    assert_eq!(feed.len(), 17 + 1 + FILLS_A_READER + 1);

    // Each stalled reader is closed once a write to it has waited 3 s, each from the
    // moment its own buffers filled: so all three places are back only when three new
    // streams are served at once. (Reading a stalled reader before its limit is up lets
    // its writes go on: the check below waits for the three places first.) Each new
    // stream is read to the feed's end meanwhile, and kept open, so it keeps its place.
    let started = Instant::now();
    let mut served = Vec::new();
    for n in 1..=3 {
        let stream = eventually(
            &format!("new stream {n} is served once a stalled reader is closed"),
            SERVED_WITHIN,
            Duration::from_millis(250),
            async || {
                let response = connect(&app, "", None, None).await;
                match response.status().as_u16() {
                    200 => Some(as_stream(response, "a new stream")),
                    503 => None,
                    other => panic!("{other}: {}", response.text().await.unwrap_or_default()),
                }
            },
        )
        .await;
        let whole = feed.len();
        served.push(tokio::spawn(async move {
            let mut stream = stream;
            let events = stream.events(whole, SERVED_WITHIN).await;
            (events, stream)
        }));
    }
    eprintln!(
        "three new streams served {:?} after the feed was whole",
        started.elapsed()
    );
    // The stalled readers' connections were closed by the server: what is left in them
    // reads to the end (a reset, or the end of the stream). What the kernel still held
    // for one of them drains slowly through the reader's small window, so the check is
    // that the connection never goes quiet without ending. (Before the server capped
    // its connections' send buffers, one of them took the whole feed, 1.9 MB, in one run
    // of ten: its writes never waited, and it was open, and quiet, with its place.)
    for mut reader in stalled {
        read_until_closed(&mut reader, Duration::from_secs(10)).await;
    }
    // The new streams read the feed from its start; each kept its place until here.
    let mut open = Vec::new();
    for stream in served {
        let (got, stream) = stream.await.expect("a new stream's reader");
        assert_eq!(stream_ids(&got), ids(&feed));
        open.push(stream);
    }
    drop(open);
}

/// SIGTERM ends the process within a bounded time even with readers that stopped reading
/// (the shutdown's grace is 5 s, `CLOSE_WITHIN`, then open connections are closed):
/// before, it waited for them for ever. A real process, signalled, with the default
/// settings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_ends_the_process_within_a_bound_even_with_readers_that_stopped_reading() {
    use support::process::{Instance, InstanceConfig};
    /// The grace, the 10 s limit of the background transfers (none here) and slack; the
    /// write limit (20 s by default) is above it, so the grace is what ends the stalled
    /// readers.
    const EXITS_WITHIN: Duration = Duration::from_secs(15);
    let uri = support::database_uri();
    let database = support::fresh_database_name();
    let config = InstanceConfig::new(support::service_binary!(), &uri, &database, "stopping");
    let mut instance = Instance::start(&config).await;
    let http = reqwest::Client::new();
    let store = transfer_service::store::Store::connect(&uri, &database)
        .await
        .expect("connect");
    let template = large_transfer(&http, &instance.base, store.database()).await;
    let mut stalled = Vec::new();
    for _ in 0..3 {
        stalled.push(stalled_reader(&instance.base).await);
    }
    flood(store.database(), &template, FILLS_A_READER).await;
    let opened = http
        .post(instance.url("/accounts"))
        .json(&json!({ "id": "barrier", "balance": 0 }))
        .send()
        .await
        .unwrap();
    assert_eq!(opened.status(), 201);
    // Every event recorded (the followers send each within 100 ms of its recording, so
    // the readers' buffers are full by then).
    let mut query = "?limit=1000".to_owned();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let page: Value = http
            .get(instance.url(&format!("/events{query}")))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let items = page["items"].as_array().expect("items");
        if ids(items).iter().any(|id| id == "account.opened:barrier") {
            break;
        }
        if items.is_empty() {
            assert!(
                Instant::now() < deadline,
                "the barrier is not recorded in time"
            );
            tokio::time::sleep(POLL_EVERY).await;
        }
        query = format!("?limit=1000&after={}", page["next"].as_str().expect("next"));
    }

    let signalled = Instant::now();
    instance.signal(libc::SIGTERM);
    let status = instance.wait_exit(EXITS_WITHIN).await;
    let status = status.unwrap_or_else(|| {
        panic!("still running {EXITS_WITHIN:?} after SIGTERM, with readers that stopped reading")
    });
    eprintln!("exited {:?} after SIGTERM: {status}", signalled.elapsed());
    assert!(status.success(), "{status}");
    drop(stalled);
}

/// A page of large events outweighs the queue's bytes: a reader that keeps reading is
/// paced by it, never disconnected, and gets every event once, in the feed's order.
#[tokio::test]
async fn a_reader_that_keeps_reading_large_events_is_never_disconnected() {
    const N: usize = 600;
    let app = spawn_app().await;
    let template = large_transfer(&app.http, &app.address, app.store.database()).await;
    let mut stream = open_stream(&app, "", None).await;
    flood(app.store.database(), &template, N).await;
    let feed = whole_feed_within(&app, "barrier", Duration::from_secs(60)).await;
    let got = stream.events(feed.len(), Duration::from_secs(60)).await;
    assert_eq!(stream_ids(&got), ids(&feed), "every event once, in order");
}

/// A follower's queue is bounded by bytes too: with events each some 3 KB of JSON (a
/// transfer of 16 legs between 64-character account ids), a reader that does not read is
/// disconnected once 512 KiB of them have waited 5 s, fewer than 256, with a final
/// comment saying so, and resumes from its last id with exactly the rest.
#[tokio::test]
async fn a_reader_that_falls_512_kib_of_large_events_behind_is_disconnected_and_resumes() {
    const FELL_BEHIND_IN_BYTES: &str = "disconnected: this reader fell 512 KiB of events behind";
    // A reader that reads nothing until the end (see the test of 256 events).
    let app = spawn_app_with(|s| s.http_write_timeout = Duration::from_secs(600)).await;
    let template = large_transfer(&app.http, &app.address, app.store.database()).await;
    let mut slow = raw_request(&app, "/events/stream", Some(4096), true).await;
    let (head, mut raw) = read_head(&mut slow).await;
    assert_stream_head(&head);
    flood(app.store.database(), &template, FILLS_A_READER).await;
    let feed = whole_feed_within(&app, "barrier", Duration::from_secs(60)).await;
    assert_eq!(feed.len(), 17 + 1 + FILLS_A_READER + 1);
    // The follower waits 5 s for room in its queue's bytes before it stops (a consumer
    // that keeps reading is paced, not cut): the reader takes nothing for longer. The
    // follower has read the last events within 2 s of their recording.
    tokio::time::sleep(Duration::from_secs(10)).await;

    raw.extend(read_until_closed(&mut slow, Duration::from_secs(10)).await);
    let (body, complete) = dechunk(&raw);
    assert!(complete, "the body ends with its last chunk");
    assert_eq!(
        last_line(&body),
        format!(": {FELL_BEHIND_IN_BYTES}; reconnect with Last-Event-ID"),
        "the last line says why"
    );
    let (frames, _) = parse_frames(&body);
    let got: Vec<StreamEvent> = frames
        .iter()
        .filter_map(|f| match f {
            Frame::Event(e) => Some(e.clone()),
            Frame::Comment(_) => None,
        })
        .collect();
    assert!(got.len() < feed.len(), "{} of {}", got.len(), feed.len());
    assert_eq!(
        stream_data(&got),
        feed[..got.len()],
        "what it got, in order"
    );
    let resumed_from = got.last().expect("some events").cursor.clone();
    let (rest, _, reconnections) = read_resuming(&app, &resumed_from, feed.len() - got.len()).await;
    assert_eq!(
        stream_ids(&rest),
        ids(&feed[got.len()..]),
        "resumed ({reconnections} reconnections): the events it missed, none twice"
    );
}

#[tokio::test]
async fn at_most_max_event_streams_are_open_at_once_and_a_closed_ones_place_is_free_again() {
    let app = spawn_app_with(|s| s.max_event_streams = 2).await;
    let first = open_stream(&app, "", None).await;
    let mut second = open_stream(&app, "", None).await;

    let refused = connect(&app, "", None, None).await;
    let retry_after = refused
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    assert_problem(refused, 503, "too_many_streams").await;
    let retry_after = retry_after.expect("a Retry-After header");
    assert!(
        retry_after.parse::<u64>().is_ok_and(|s| s > 0),
        "Retry-After: {retry_after:?}"
    );
    // The feed itself is not limited.
    events_page(&app, "").await;

    drop(first);
    // The server learns that the reader left when it next writes to the connection or
    // polls it; no event is made here, so this is about noticing the closed connection
    // by itself.
    let mut third = eventually(
        "a closed stream's place is free again",
        Duration::from_secs(5),
        Duration::from_millis(50),
        async || {
            let response = connect(&app, "", None, None).await;
            match response.status().as_u16() {
                200 => Some(as_stream(response, "the third stream")),
                503 => {
                    assert_problem(response, 503, "too_many_streams").await;
                    None
                }
                other => panic!("{other}: {}", response.text().await.unwrap_or_default()),
            }
        },
    )
    .await;
    // Two again: one more is refused.
    assert_problem(connect(&app, "", None, None).await, 503, "too_many_streams").await;
    // Both open streams work.
    open(&app, "alice", 0).await;
    assert_eq!(second.event().await.id(), "account.opened:alice");
    assert_eq!(third.event().await.id(), "account.opened:alice");
}

#[tokio::test]
async fn a_cursor_or_a_type_the_stream_cannot_read_is_400_never_500() {
    let app = spawn_app_with(|s| s.max_event_streams = 1).await;
    whole_feed(&app, "alice").await;
    let garbage_json = "eyJoZWxsbyI6WyJ3b3JsZCJdfQ"; // {"hello":["world"]}
    let cases: [(&str, Option<&str>, &str); 7] = [
        ("", Some("garbage"), "Last-Event-ID garbage"),
        ("", Some(garbage_json), "Last-Event-ID, JSON not a cursor"),
        ("?after=garbage", None, "after=garbage"),
        ("?after=", None, "after empty"),
        ("?type=nope", None, "type=nope"),
        ("?type=transfer.done,nope", None, "type=transfer.done,nope"),
        ("?after=garbage", Some("garbage"), "both garbage"),
    ];
    for (query, last_event_id, what) in cases {
        let response = connect(&app, query, last_event_id, None).await;
        let problem = assert_problem(response, 400, "invalid_parameter").await;
        if query.starts_with("?type") {
            assert_eq!(problem["field"], "type", "{what}: {problem}");
        }
        if query.starts_with("?after") && last_event_id.is_none() {
            assert_eq!(problem["field"], "after", "{what}: {problem}");
        }
        if last_event_id.is_some() {
            assert_eq!(problem["field"], "Last-Event-ID", "{what}: {problem}");
        }
    }
    // A bad header loses to nothing: refused even with a good ?after=.
    let (_, next) = events_page(&app, "").await;
    let response = connect(&app, &format!("?after={next}"), Some("garbage"), None).await;
    assert_problem(response, 400, "invalid_parameter").await;
    // The refused requests hold no place (MAX_EVENT_STREAMS = 1 here), and a good
    // header wins over a bad ?after=.
    let mut good = open_stream(&app, "?after=garbage", Some(&next)).await;
    open(&app, "bob", 0).await;
    assert_eq!(good.event().await.id(), "account.opened:bob");
}

/// A forged cursor, in `Last-Event-ID` or in `?after=`, is refused 400 saying why and
/// holds no place; the largest a client can hold opens a stream, one character more is
/// refused. (The cursor's bounds themselves are the feed's: tests/api/events.rs.)
#[tokio::test]
async fn a_forged_cursor_is_refused_400_saying_why_and_the_largest_real_one_opens_a_stream() {
    use base64::Engine;
    use base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let app = spawn_app_with(|s| s.max_event_streams = 1).await;
    let forged = |json: &str| URL_SAFE_NO_PAD.encode(json);
    let many: Vec<String> = (0..500)
        .map(|i| format!(r#""d{i}":[1,0,"account.opened:alice"]"#))
        .collect();
    let cases = [
        (
            forged(&format!(r#"{{"v":1,"p":{{{}}}}}"#, many.join(","))),
            "longer than any cursor",
        ),
        (
            forged(r#"{"v":1,"p":{"us":[1,0,"account.opened:alice"]}}"#),
            "does not serve",
        ),
        (
            forged(r#"{"v":1,"p":{"default":[1,0,""],"default":[2,0,""]}}"#),
            "twice",
        ),
        (
            forged(r#"{"v":1,"p":{"default":[1,0,"a-forged-id"]}}"#),
            "no event's",
        ),
    ];
    for (cursor, why) in &cases {
        for (query, header, field) in [
            (format!("?after={cursor}"), None, "after"),
            (String::new(), Some(cursor.as_str()), "Last-Event-ID"),
        ] {
            let response = connect(&app, &query, header, None).await;
            let problem = assert_problem(response, 400, "invalid_parameter").await;
            assert_eq!(problem["field"], field, "{problem}");
            assert!(
                problem["detail"].as_str().is_some_and(|d| d.contains(why)),
                "wanted {why:?}: {problem}"
            );
        }
    }
    let id = format!("account.opened:{}", "a".repeat(64));
    let added: Vec<String> = (0..4).map(|i| format!(r#""{i:z>32}":[0,0,""]"#)).collect();
    let largest = forged(&format!(
        r#"{{"v":1,"p":{{"default":[4294967295,4294967295,"{id}"],{}}}}}"#,
        added.join(",")
    ));
    let response = connect(&app, "", Some(&format!("{largest}A")), None).await;
    let problem = assert_problem(response, 400, "invalid_parameter").await;
    assert_eq!(problem["field"], "Last-Event-ID", "{problem}");
    // The refusals held no place (one here): the largest real cursor opens the stream.
    let stream = open_stream(&app, "", Some(&largest)).await;
    drop(stream);
}

/// A `Last-Event-ID` that is not even text (bytes beyond ASCII, which HTTP allows in a
/// header) is a bad cursor like any other: 400 `invalid_parameter`, as documented
/// (docs/api.md; the OpenAPI document gives the stream 400, 410 and 503 only).
#[tokio::test]
async fn a_last_event_id_that_is_not_text_is_400_invalid_parameter() {
    let app = spawn_app().await;
    let response = app
        .http
        .get(app.url("/events/stream"))
        .header(
            "last-event-id",
            reqwest::header::HeaderValue::from_bytes(b"\xff\xfe").unwrap(),
        )
        .send()
        .await
        .expect("request");
    let problem = assert_problem(response, 400, "invalid_parameter").await;
    assert_eq!(problem["field"], "Last-Event-ID", "{problem}");
}

#[tokio::test]
async fn a_cursor_whose_next_events_were_removed_is_410_at_connect() {
    // Two streams at most: the refusals below, answered once a place was taken, must
    // give it back for the two streams opened after them.
    let app = spawn_app_with(|s| {
        s.event_retention = Duration::from_secs(1);
        s.max_event_streams = 2;
    })
    .await;
    open(&app, "alice", 10).await;
    open(&app, "bob", 0).await;
    let mut stream = open_stream(&app, "", None).await;
    let got = stream.events(2, DELIVERED_WITHIN).await;
    drop(stream);
    eventually(
        "the retention removes the events made",
        Duration::from_secs(15),
        Duration::from_millis(50),
        async || events_page(&app, "").await.0.is_empty().then_some(()),
    )
    .await;
    let first = &got[0].cursor;
    let response = connect(&app, "", Some(first), None).await;
    let problem = assert_problem(response, 410, "cursor_expired").await;
    assert!(problem.get("field").is_none(), "{problem}");
    let response = connect(&app, &format!("?after={first}"), None, None).await;
    assert_problem(response, 410, "cursor_expired").await;
    // Nothing after the last event was removed: its id still resumes; and a stream
    // without a cursor starts at the oldest event kept.
    let mut from_last = open_stream(&app, "", Some(&got[1].cursor)).await;
    let mut from_front = open_stream(&app, "", None).await;
    open(&app, "carol", 0).await;
    assert_eq!(from_last.event().await.id(), "account.opened:carol");
    assert_eq!(from_front.event().await.id(), "account.opened:carol");
}

#[tokio::test]
async fn a_shutdown_ends_every_stream_with_a_final_comment_and_closes_its_connection() {
    let app = spawn_app().await;
    open(&app, "alice", 0).await;
    let mut stream = open_stream(&app, "", None).await;
    assert_eq!(stream.event().await.id(), "account.opened:alice");
    // On a connection of its own, kept alive after the answer unless the server closes it.
    let mut raw = raw_request(&app, "/events/stream?type=transfer.done", None, false).await;
    let (head, mut body) = read_head(&mut raw).await;
    assert_stream_head(&head);

    let stopping = Instant::now();
    drop(app);
    let within = Duration::from_secs(5);
    match stream.next_frame(within).await {
        Some(Frame::Comment(text)) => assert!(text.starts_with(SHUTTING_DOWN), "{text}"),
        other => panic!("the last frame before a shutdown: {other:?}"),
    }
    assert!(
        stream.next_frame(within).await.is_none(),
        "then the stream ends"
    );
    body.extend(read_until_closed(&mut raw, within).await);
    let (body, complete) = dechunk(&body);
    assert!(complete, "the body ends with its last chunk");
    assert!(
        last_line(&body).starts_with(&format!(": {SHUTTING_DOWN}")),
        "{:?}",
        String::from_utf8_lossy(&body)
    );
    assert!(
        stopping.elapsed() < within,
        "both streams ended and closed within {within:?}"
    );
}

#[tokio::test]
async fn with_api_keys_a_read_only_key_may_follow_the_stream_and_no_key_may_not() {
    let rw = format!("rw-{}", mongodb::bson::oid::ObjectId::new().to_hex());
    let ro = format!("ro-{}", mongodb::bson::oid::ObjectId::new().to_hex());
    let keys = parse_api_keys(&format!("rw:{rw},ro:{ro}")).unwrap();
    let app = spawn_app_with(|s| s.api_keys = keys).await;

    let response = connect(&app, "", None, None).await;
    assert_problem(response, 401, "unauthorized").await;
    let response = connect(&app, "", None, Some("not-a-key-at-all-0000")).await;
    assert_problem(response, 401, "unauthorized").await;

    let mut stream = as_stream(
        connect(&app, "", None, Some(&ro)).await,
        "GET /events/stream with a read-only key",
    );
    let response = app
        .http
        .post(app.url("/accounts"))
        .bearer_auth(&rw)
        .json(&json!({ "id": "alice", "balance": 0 }))
        .send()
        .await
        .expect("request");
    assert_eq!(response.status(), 201);
    assert_eq!(stream.event().await.id(), "account.opened:alice");
}
