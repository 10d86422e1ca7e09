//! A request that does not keep its connection's read buffer alive.
//!
//! hyper parses a request in place: its path and its header values are slices of the
//! connection's read buffer (8 KiB), and keep that buffer alive for as long as the request
//! lives. Meanwhile hyper goes on reading the connection (to notice a client that goes
//! away) into a new buffer of 8 KiB. So every request waiting for an admission permit
//! held two read buffers: at 1,000 connections in a burst, 8 MiB more than the
//! connections need (`docs/benchmark/decisions.md`, memory under a burst).
//!
//! [`detached`] copies the path and the header values (a few hundred bytes) into
//! allocations of their own as the request arrives; once its body has been read, nothing
//! of the request holds the buffer it was read into, and the buffer is freed.

use axum::http::{HeaderValue, Request, Uri};

/// `request` with its URI and header values copied out of the buffer hyper parsed them in
/// (header names are copies already: hyper makes them with `HeaderName::from_bytes`). A
/// part that cannot be copied as it is (never for what hyper accepts) is kept as it came.
pub fn detached<B>(mut request: Request<B>) -> Request<B> {
    for value in request.headers_mut().values_mut() {
        if let Ok(mut copy) = HeaderValue::from_bytes(value.as_bytes()) {
            copy.set_sensitive(value.is_sensitive());
            *value = copy;
        }
    }
    if let Ok(uri) = Uri::try_from(request.uri().to_string()) {
        *request.uri_mut() = uri;
    }
    request
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::{Bytes, BytesMut};

    const READ_BUFFER: usize = 8192;

    /// A request as hyper makes it: its path and header values slices of `buffer`'s
    /// first bytes, split off and frozen, as hyper's parser does.
    fn parsed_in(buffer: &mut BytesMut) -> Request<()> {
        buffer.extend_from_slice(b"/transfers?limit=10prefer: respond-asyncorder-42");
        let head: Bytes = buffer.split().freeze();
        let mut request = Request::new(());
        *request.uri_mut() = Uri::from_maybe_shared(head.slice(0..19)).unwrap();
        let headers = request.headers_mut();
        headers.append(
            "prefer",
            HeaderValue::from_maybe_shared(head.slice(27..40)).unwrap(),
        );
        headers.append(
            "idempotency-key",
            HeaderValue::from_maybe_shared(head.slice(40..48)).unwrap(),
        );
        let mut secret = HeaderValue::from_maybe_shared(head.slice(40..48)).unwrap();
        secret.set_sensitive(true);
        headers.append("authorization", secret);
        request
    }

    /// The buffer can be used again in place (nothing else refers to it) only once the
    /// request no longer refers to it: before the fix, the request kept it alive.
    #[test]
    fn a_detached_request_no_longer_holds_the_buffer_it_was_parsed_in() {
        let mut buffer = BytesMut::with_capacity(READ_BUFFER);
        let request = parsed_in(&mut buffer);
        assert!(
            !buffer.try_reclaim(READ_BUFFER),
            "the parsed request holds the buffer"
        );
        let request = detached(request);
        assert!(
            buffer.try_reclaim(READ_BUFFER),
            "the detached request still holds the buffer"
        );
        drop(request);
    }

    #[test]
    fn a_detached_request_says_the_same() {
        let mut buffer = BytesMut::with_capacity(READ_BUFFER);
        let original = parsed_in(&mut buffer);
        let expected_uri = original.uri().clone();
        let expected: Vec<(String, Vec<u8>, bool)> = original
            .headers()
            .iter()
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec(), v.is_sensitive()))
            .collect();
        let copy = detached(original);
        assert_eq!(copy.uri(), &expected_uri);
        assert_eq!(copy.uri().query(), Some("limit=10"));
        let got: Vec<(String, Vec<u8>, bool)> = copy
            .headers()
            .iter()
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec(), v.is_sensitive()))
            .collect();
        assert_eq!(got, expected);
        assert!(
            got.iter()
                .any(|(n, _, sensitive)| n == "authorization" && *sensitive)
        );
    }
}
