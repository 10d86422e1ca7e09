//! [`Chain`]: an error and its sources on one line, for a log field.
//!
//! A leaf of the crate: every layer logs errors with it, so it names no module of the
//! crate, only `std` (`tests/architecture.rs` holds it to that). Anything it imported
//! would be imported, through it, by every layer.

/// An error and its sources on one line (`a: b: c`), for a log field
/// (`error = %Chain(&e)`): an error's own message says what failed (a store error says
/// only its kind) and its sources say why, but the JSON format writes only the message.
pub struct Chain<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(cause) = source {
            write!(f, ": {cause}")?;
            source = cause.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error that says what failed and, maybe, why.
    #[derive(Debug)]
    struct Failed {
        what: &'static str,
        why: Option<Box<Failed>>,
    }

    impl std::fmt::Display for Failed {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.what)
        }
    }

    impl std::error::Error for Failed {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.why.as_deref().map(|e| e as _)
        }
    }

    fn failed(what: &'static str, why: Option<Failed>) -> Failed {
        Failed {
            what,
            why: why.map(Box::new),
        }
    }

    #[test]
    fn a_chain_is_the_message_then_every_source_outermost_first() {
        let err = failed(
            "transfer interrupted",
            Some(failed(
                "the database is unavailable",
                Some(failed("no primary", None)),
            )),
        );
        assert_eq!(
            Chain(&err).to_string(),
            "transfer interrupted: the database is unavailable: no primary"
        );
    }

    #[test]
    fn an_error_without_a_source_is_its_message_alone() {
        let err = failed("no primary", None);
        assert_eq!(Chain(&err).to_string(), "no primary");
    }
}
