//! Latency summaries: nearest-rank percentiles over every sample (no histogram buckets, so
//! p99 of a few thousand samples is exact rather than a bucket bound), and the number
//! formats the report and the chart share.

use serde_json::{Value, json};

#[derive(Clone, Debug, Default)]
pub struct Summary {
    pub count: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    pub mean_ms: f64,
}

impl Summary {
    /// Summarises samples in milliseconds (any order).
    pub fn of(mut samples: Vec<f64>) -> Summary {
        if samples.is_empty() {
            return Summary::default();
        }
        samples.sort_by(f64::total_cmp);
        let n = samples.len();
        let rank = |p: f64| {
            // Nearest rank: the smallest sample with at least p of all samples at or below it.
            let r = (p * n as f64).ceil() as usize;
            samples[r.clamp(1, n) - 1]
        };
        Summary {
            count: n,
            p50_ms: rank(0.50),
            p99_ms: rank(0.99),
            max_ms: samples[n - 1],
            mean_ms: samples.iter().sum::<f64>() / n as f64,
        }
    }

    pub fn json(&self) -> Value {
        json!({
            "samples": self.count,
            "p50_ms": round3(self.p50_ms),
            "p99_ms": round3(self.p99_ms),
            "max_ms": round3(self.max_ms),
            "mean_ms": round3(self.mean_ms),
        })
    }
}

pub fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// `1234567.0` as `1,234,567`.
pub fn thousands(v: f64) -> String {
    let n = v.round() as i64;
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 { format!("-{out}") } else { out }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let s = Summary::of((1..=100).rev().map(f64::from).collect());
        assert_eq!(s.count, 100);
        assert_eq!(s.p50_ms, 50.0);
        assert_eq!(s.p99_ms, 99.0);
        assert_eq!(s.max_ms, 100.0);
        let one = Summary::of(vec![7.0]);
        assert_eq!((one.p50_ms, one.p99_ms, one.max_ms), (7.0, 7.0, 7.0));
        assert_eq!(Summary::of(vec![]).count, 0);
    }

    #[test]
    fn thousands_are_grouped() {
        assert_eq!(thousands(0.0), "0");
        assert_eq!(thousands(999.4), "999");
        assert_eq!(thousands(1000.0), "1,000");
        assert_eq!(thousands(5_000_000.0), "5,000,000");
        assert_eq!(thousands(-1234.0), "-1,234");
    }
}
