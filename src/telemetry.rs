//! Logging set-up: `pretty` for people, `json` for one JSON object a line.
//!
//! In `json`, each line is one event: `timestamp`, `level`, `target`, `message` and the
//! event's own fields (`transfer_id`, say) at the top level, the innermost span's fields
//! under `span`, and every enclosing span, outermost first, under `spans`. So an event
//! logged while serving a request carries that request's `request_id` (the
//! `x-request-id` answered to the client) in `span` or `spans`.

use tracing::Subscriber;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::util::SubscriberInitExt;

use crate::config::LogFormat;

/// Installs the global subscriber, writing to stdout. Call once, from `main`.
pub fn init(format: LogFormat, filter: &str) {
    subscriber(format, filter, std::io::stdout).init();
}

/// The subscriber [`init`] installs, writing to `writer`: tests give it a buffer.
pub fn subscriber<W>(
    format: LogFormat,
    filter: &str,
    writer: W,
) -> Box<dyn Subscriber + Send + Sync>
where
    W: for<'a> MakeWriter<'a> + Send + Sync + 'static,
{
    let filter = EnvFilter::try_new(filter).unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(true)
        .with_writer(writer);
    match format {
        LogFormat::Pretty => Box::new(builder.finish()),
        LogFormat::Json => Box::new(
            builder
                .json()
                .flatten_event(true)
                .with_current_span(true)
                .with_span_list(true)
                .finish(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::{Arc, Mutex};

    use super::*;

    /// A log destination the test can read back.
    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl Write for Buffer {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Buffer {
        type Writer = Buffer;

        fn make_writer(&'a self) -> Buffer {
            self.clone()
        }
    }

    #[test]
    fn json_logs_are_one_object_a_line_carrying_the_request_id_of_their_span() {
        let buffer = Buffer::default();
        let subscriber = subscriber(LogFormat::Json, "info", buffer.clone());
        tracing::subscriber::with_default(subscriber, || {
            let request = tracing::info_span!("request", method = "POST", request_id = "req-42");
            let _request = request.enter();
            tracing::info!(
                transfer_id = "65a1b2c3d4e5f60718293a4b",
                from = "pending",
                to = "applied",
                "transfer state changed"
            );
            let step = tracing::info_span!("step", name = "credit");
            let _step = step.enter();
            tracing::warn!("inside a nested span");
        });

        let text = String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}")))
            .collect();
        assert_eq!(lines.len(), 2, "{text}");

        let changed = &lines[0];
        assert_eq!(changed["level"], "INFO");
        assert_eq!(changed["message"], "transfer state changed");
        assert_eq!(changed["transfer_id"], "65a1b2c3d4e5f60718293a4b");
        assert_eq!(changed["to"], "applied");
        assert_eq!(changed["target"], module_path!());
        assert!(changed["timestamp"].is_string(), "{changed}");
        assert_eq!(changed["span"]["name"], "request");
        assert_eq!(changed["span"]["request_id"], "req-42");

        let nested = &lines[1];
        assert_eq!(nested["span"]["name"], "step");
        assert_eq!(nested["spans"][0]["name"], "request");
        assert_eq!(nested["spans"][0]["request_id"], "req-42");
        assert_eq!(nested["spans"][1]["name"], "step");
    }
}
