//! [`LatencyHistogram`]: the consumer's commit→consume latencies in constant memory.
//! Invariant: a quantile is never above the largest value recorded.

use std::time::Duration;

/// Latencies in log-spaced buckets (5 % apart, 50 µs to about 17 minutes): constant memory
/// whatever the run's length, percentiles within 5 %.
#[derive(Clone, Debug)]
pub struct LatencyHistogram {
    counts: Vec<u64>,
    total: u64,
    max: Duration,
}

const HIST_BASE_SECS: f64 = 50e-6;
const HIST_GROWTH: f64 = 1.05;
const HIST_BUCKETS: usize = 350;

impl Default for LatencyHistogram {
    fn default() -> Self {
        LatencyHistogram {
            counts: vec![0; HIST_BUCKETS],
            total: 0,
            max: Duration::ZERO,
        }
    }
}

impl LatencyHistogram {
    /// Counts one latency.
    pub fn record(&mut self, d: Duration) {
        let secs = d.as_secs_f64();
        let i = if secs <= HIST_BASE_SECS {
            0
        } else {
            ((secs / HIST_BASE_SECS).ln() / HIST_GROWTH.ln()).ceil() as usize
        };
        self.counts[i.min(HIST_BUCKETS - 1)] += 1;
        self.total += 1;
        self.max = self.max.max(d);
    }

    /// How many latencies were recorded.
    pub fn count(&self) -> u64 {
        self.total
    }

    /// The largest latency recorded, exactly.
    pub fn max(&self) -> Option<Duration> {
        (self.total > 0).then_some(self.max)
    }

    /// The upper bound of the bucket holding quantile `q` (0..=1), never above the maximum.
    pub fn quantile(&self, q: f64) -> Option<Duration> {
        if self.total == 0 {
            return None;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank && i + 1 < HIST_BUCKETS {
                let upper = Duration::from_secs_f64(HIST_BASE_SECS * HIST_GROWTH.powi(i as i32));
                return Some(upper.min(self.max));
            }
        }
        Some(self.max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_quantiles_are_within_five_percent() {
        let mut h = LatencyHistogram::default();
        assert_eq!(h.quantile(0.5), None);
        for ms in 1..=1000u64 {
            h.record(Duration::from_millis(ms));
        }
        assert_eq!(h.count(), 1000);
        let p50 = h.quantile(0.5).unwrap().as_secs_f64() * 1000.0;
        let p99 = h.quantile(0.99).unwrap().as_secs_f64() * 1000.0;
        assert!((500.0..=525.0).contains(&p50), "p50 {p50}");
        assert!((990.0..=1000.0).contains(&p99), "p99 {p99}");
        assert_eq!(h.max(), Some(Duration::from_millis(1000)));
        assert_eq!(h.quantile(1.0), Some(Duration::from_millis(1000)));
    }

    #[test]
    fn histogram_keeps_tiny_and_huge_values() {
        let mut h = LatencyHistogram::default();
        h.record(Duration::ZERO);
        h.record(Duration::from_secs(100_000));
        assert_eq!(
            h.quantile(0.0).unwrap(),
            Duration::from_secs_f64(HIST_BASE_SECS)
        );
        assert_eq!(h.quantile(1.0), Some(Duration::from_secs(100_000)));
    }
}
