//! Latency summaries and the tally of failed requests.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

/// Latency of the successful requests of one measurement, in milliseconds.
#[derive(Debug, Clone, Serialize)]
pub struct Latency {
    pub count: usize,
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p95_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Nearest-rank percentiles of `samples` (sorted here); None when empty.
pub fn summarize(mut samples: Vec<Duration>) -> Option<Latency> {
    if samples.is_empty() {
        return None;
    }
    samples.sort_unstable();
    let n = samples.len();
    let rank = |p: f64| samples[((p * n as f64).ceil() as usize).clamp(1, n) - 1];
    let total: Duration = samples.iter().sum();
    Some(Latency {
        count: n,
        mean_ms: ms(total) / n as f64,
        p50_ms: ms(rank(0.50)),
        p95_ms: ms(rank(0.95)),
        p99_ms: ms(rank(0.99)),
        max_ms: ms(samples[n - 1]),
    })
}

/// How many times each kind of failure happened (`"422 insufficient_funds"`,
/// `"transport: ..."`), with the first few answer bodies of each kind.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Failures {
    pub total: u64,
    pub by_kind: BTreeMap<String, u64>,
    pub samples: BTreeMap<String, Vec<String>>,
}

const SAMPLES_PER_KIND: usize = 3;

impl Failures {
    pub fn add(&mut self, kind: &str, detail: &str) {
        self.total += 1;
        *self.by_kind.entry(kind.to_owned()).or_default() += 1;
        let samples = self.samples.entry(kind.to_owned()).or_default();
        if samples.len() < SAMPLES_PER_KIND && !samples.iter().any(|s| s == detail) {
            samples.push(detail.chars().take(600).collect());
        }
    }

    pub fn merge(&mut self, other: Failures) {
        self.total += other.total;
        for (kind, n) in other.by_kind {
            *self.by_kind.entry(kind).or_default() += n;
        }
        for (kind, samples) in other.samples {
            let mine = self.samples.entry(kind).or_default();
            for s in samples {
                if mine.len() < SAMPLES_PER_KIND && !mine.contains(&s) {
                    mine.push(s);
                }
            }
        }
    }

    /// `"3 × 503 request_timeout, 1 × transport: ..."`, or `"none"`.
    pub fn brief(&self) -> String {
        if self.total == 0 {
            return "none".into();
        }
        self.by_kind
            .iter()
            .map(|(kind, n)| format!("{n} × {kind}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let v: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        let l = summarize(v).unwrap();
        assert_eq!(l.p50_ms, 50.0);
        assert_eq!(l.p99_ms, 99.0);
        assert_eq!(l.max_ms, 100.0);
        assert!((l.mean_ms - 50.5).abs() < 1e-9);
        assert!(summarize(Vec::new()).is_none());
    }
}
