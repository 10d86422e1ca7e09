//! The vocabulary of the service: values that parse instead of validate, and the
//! transfer state machine.
//!
//! Nothing here knows about HTTP or MongoDB. A value of one of these types is valid by
//! construction, so the layers above never re-check it:
//! - [`AccountId`], [`Currency`], [`Amount`], [`OpeningBalance`], [`TransferId`],
//!   [`IdempotencyKey`], [`Reference`] and [`AccountName`] are parsed once at the edge;
//! - [`TransferState`] is the two-phase-commit state machine of the MongoDB tutorial,
//!   with its transitions as an explicit function ([`TransferState::transition`]).

mod state;
mod values;

pub use state::{CancelReason, InvalidTransition, TransferEvent, TransferState};
pub use values::{
    AccountId, AccountName, Amount, Currency, IdempotencyKey, MAX_MONEY, OpeningBalance,
    ParseError, Reference, TransferId,
};

#[cfg(test)]
mod tests {
    use std::path::Path;

    /// The words a module may not name, checked on its source: the domain is every
    /// layer's vocabulary, so it depends on no framework, no driver and no other layer
    /// (the import rule in the crate map).
    const NOT_IN_THE_DOMAIN: &[&str] = &[
        "axum",
        "mongodb",
        "bson",
        "crate::store",
        "crate::service",
        "crate::http",
        "crate::sweeper",
    ];

    #[test]
    fn the_domain_names_no_framework_no_driver_and_no_other_layer() {
        let folder = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/domain");
        let mut read = 0;
        for entry in std::fs::read_dir(&folder).unwrap() {
            let path = entry.unwrap().path();
            let text = std::fs::read_to_string(&path).unwrap();
            // Every line but the string literals of this test's own list.
            let lines = text.lines().enumerate();
            let code = lines.filter(|(_, l)| !l.trim_start().starts_with('"'));
            for (number, line) in code {
                for word in NOT_IN_THE_DOMAIN {
                    let at = format!("{}:{}", path.display(), number + 1);
                    assert!(!line.contains(word), "{at} names {word}: {line}");
                }
            }
            read += 1;
        }
        assert!(read >= 3, "read {read} files of {}", folder.display());
    }
}
