//! What the demo shows: a [`Progress`] line about once a second and the [`Summary`] at the
//! end, as `main` prints them. Latencies print in milliseconds, "-" when there are none.

use std::fmt;
use std::time::Duration;

/// A live view, about once a second.
#[derive(Clone, Debug)]
pub struct Progress {
    /// Since the clock started (after the warm-up).
    pub elapsed: Duration,
    /// Events produced so far.
    pub produced: u64,
    /// Rows the relay marked dispatched (the broker confirmed them).
    pub published: u64,
    /// Distinct events the consumer handled.
    pub consumed: u64,
    /// Median commit→consume latency so far.
    pub p50: Option<Duration>,
    /// 99th percentile commit→consume latency so far.
    pub p99: Option<Duration>,
    /// Producing is over; waiting for the backlog.
    pub draining: bool,
}

impl fmt::Display for Progress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "demo {:>4.0}s{}: produced {}, published {}, consumed {}, latency p50 {} p99 {}",
            self.elapsed.as_secs_f64(),
            if self.draining { " (draining)" } else { "" },
            self.produced,
            self.published,
            self.consumed,
            ms(self.p50),
            ms(self.p99),
        )
    }
}

/// How the demo ended.
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    /// Events produced (committed).
    pub produced: u64,
    /// Rows the relay marked dispatched (the broker confirmed them).
    pub published: u64,
    /// Distinct events of this run the consumer handled.
    pub consumed: u64,
    /// Produced and never consumed (within the drain timeout).
    pub lost: u64,
    /// Events the handler saw again after it had handled them (the inbox should make this 0).
    pub duplicates: u64,
    /// Events consumed that this run did not produce (left in the queue by an earlier run).
    pub stray: u64,
    /// Median commit→consume latency.
    pub p50: Option<Duration>,
    /// 99th percentile commit→consume latency.
    pub p99: Option<Duration>,
    /// Longest commit→consume latency.
    pub max: Option<Duration>,
    /// From the first event produced to the last one consumed (or the end of the drain).
    pub elapsed: Duration,
    /// The rate production reached.
    pub rate: f64,
    /// Producing was cut short by a signal.
    pub interrupted: bool,
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "demo summary: produced {}, published {}, consumed {}, lost {}, duplicates {}, stray {}; \
             latency p50 {} p99 {} max {}; {:.1}s, produced at {:.1} events/s{}",
            self.produced,
            self.published,
            self.consumed,
            self.lost,
            self.duplicates,
            self.stray,
            ms(self.p50),
            ms(self.p99),
            ms(self.max),
            self.elapsed.as_secs_f64(),
            self.rate,
            if self.interrupted {
                " (interrupted)"
            } else {
                ""
            },
        )
    }
}

fn ms(d: Option<Duration>) -> String {
    match d {
        Some(d) => format!("{:.1}ms", d.as_secs_f64() * 1000.0),
        None => "-".into(),
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_line_names_every_figure() {
        let s = Summary {
            produced: 10,
            published: 10,
            consumed: 10,
            lost: 0,
            duplicates: 0,
            stray: 0,
            p50: Some(Duration::from_micros(1500)),
            p99: None,
            max: Some(Duration::from_millis(3)),
            elapsed: Duration::from_secs(2),
            rate: 5.0,
            interrupted: false,
        };
        assert_eq!(
            s.to_string(),
            "demo summary: produced 10, published 10, consumed 10, lost 0, duplicates 0, stray 0; \
             latency p50 1.5ms p99 - max 3.0ms; 2.0s, produced at 5.0 events/s"
        );
    }
}
