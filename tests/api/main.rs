//! The HTTP API against a real database server: one test binary, one database per test.

#[path = "../support/mod.rs"]
mod support;

mod accounts;
mod transfers;
