//! What a run found, as a Markdown table (stdout, pasteable into BENCHMARKS.md) and as
//! JSON (`--json`), with the targets and how far each is. Every comparison is a
//! ratio of two figures measured in this run: absolute numbers on a shared 2-core machine
//! move from run to run, ratios much less.
//!
//! Layout: this file holds the results, the targets and the chart; `markdown.rs` the
//! table, `latency.rs` its latency tables, `json.rs` the JSON document.

use crate::sections::{
    CeilingRuns, ConsumerRuns, Drain, Growth, Latency, ProducerCost, Runner, Scale, Settings, Sweep,
};
use crate::stages::{RELAY_SHARE, STAGES};
use crate::stats::thousands;
use crate::svg;

mod json;
mod latency;
mod markdown;

/// A section's outcome: not run (`None`), measured, or failed with a message.
pub type Outcome<T> = Option<Result<T, String>>;

/// The machine the run measured on, read once at start.
pub struct Machine {
    pub cores: usize,
    pub memory_gib: f64,
    pub cpu_model: String,
    pub kernel: String,
    pub postgres: String,
    pub load_at_start: String,
}

impl Machine {
    pub fn read(postgres: String) -> Machine {
        let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
        let memory_kib: f64 = read("/proc/meminfo")
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0.0);
        Machine {
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            memory_gib: memory_kib / 1024.0 / 1024.0,
            cpu_model: read("/proc/cpuinfo")
                .lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_owned())
                .unwrap_or_default(),
            kernel: read("/proc/sys/kernel/osrelease").trim().to_owned(),
            postgres,
            load_at_start: read("/proc/loadavg")
                .split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" "),
        }
    }
}

/// Every section's outcome and what the run was given.
pub struct Results {
    pub settings: Settings,
    pub machine: Machine,
    pub started_unix: f64,
    pub duration_s: f64,
    pub ceiling: Outcome<CeilingRuns>,
    pub drain: Outcome<Drain>,
    pub latency: Outcome<Vec<Latency>>,
    pub producer: Outcome<ProducerCost>,
    pub growth: Outcome<Growth>,
    pub sweep: Outcome<Sweep>,
    pub scale: Outcome<Scale>,
    pub consumer: Outcome<ConsumerRuns>,
}

/// One target and how far the run is from it.
pub struct Target {
    pub name: String,
    pub goal: String,
    pub measured: String,
    pub met: Option<bool>,
}

fn ok<T>(o: &Outcome<T>) -> Option<&T> {
    o.as_ref().and_then(|r| r.as_ref().ok())
}

fn mb(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

impl Results {
    /// The sections that failed, with their messages.
    pub fn errors(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        let mut add = |name: &str, e: Option<&String>| {
            if let Some(e) = e {
                out.push((name.to_owned(), e.clone()));
            }
        };
        add(
            "broker_ceiling",
            self.ceiling.as_ref().and_then(|r| r.as_ref().err()),
        );
        add("drain", self.drain.as_ref().and_then(|r| r.as_ref().err()));
        add(
            "latency",
            self.latency.as_ref().and_then(|r| r.as_ref().err()),
        );
        add(
            "producer_cost",
            self.producer.as_ref().and_then(|r| r.as_ref().err()),
        );
        add(
            "growth",
            self.growth.as_ref().and_then(|r| r.as_ref().err()),
        );
        add("sweep", self.sweep.as_ref().and_then(|r| r.as_ref().err()));
        add(
            "scale_out",
            self.scale.as_ref().and_then(|r| r.as_ref().err()),
        );
        add(
            "consumer",
            self.consumer.as_ref().and_then(|r| r.as_ref().err()),
        );
        out
    }

    fn drain_ratio(&self) -> Option<f64> {
        Some(ok(&self.drain)?.rate / ok(&self.ceiling)?.rate())
    }

    fn busy_ratio(&self) -> Option<f64> {
        ok(&self.producer)?.busy_ratio()
    }

    fn latency_at(&self, rate: u64, runner: Runner) -> Option<&Latency> {
        ok(&self.latency)?
            .iter()
            .find(|l| l.target_rate == rate && l.runner == runner)
    }

    /// The latency runs of one runner, in rate order.
    fn latency_runs(&self, runner: Runner) -> Vec<&Latency> {
        ok(&self.latency).map_or(Vec::new(), |runs| {
            runs.iter().filter(|l| l.runner == runner).collect()
        })
    }

    /// Peak RSS over every drain of the run (the relay's VmHWM), MiB.
    fn peak_rss_mb(&self) -> Option<f64> {
        let mut peaks: Vec<u64> = Vec::new();
        if let Some(d) = ok(&self.drain) {
            peaks.push(d.usage.peak_rss_kib);
        }
        if let Some(g) = ok(&self.growth) {
            peaks.extend(
                g.loaded
                    .iter()
                    .chain(&g.empty)
                    .map(|d| d.usage.peak_rss_kib),
            );
        }
        if let Some(s) = ok(&self.sweep) {
            peaks.extend(s.points.iter().map(|p| p.drain.usage.peak_rss_kib));
        }
        peaks.into_iter().max().map(mb)
    }

    /// The targets, each against this run's figures.
    pub fn targets(&self) -> Vec<Target> {
        let yes = |b: bool| Some(b);
        let mut t = Vec::new();
        let dr = self.drain_ratio();
        t.push(Target {
            name: "drain rate vs broker ceiling".into(),
            goal: ">= 0.90".into(),
            measured: dr.map_or("not measured".into(), |r| format!("{r:.2}")),
            met: dr.and_then(|r| yes(r >= 0.90)),
        });
        let br = self.busy_ratio();
        t.push(Target {
            name: "producer commits/s, relay busy, vs table without triggers".into(),
            goal: ">= 0.90".into(),
            measured: br.map_or("not measured".into(), |r| format!("{r:.2}")),
            met: br.and_then(|r| yes(r >= 0.90)),
        });
        let w = ok(&self.producer).filter(|p| p.wakeup.count > 0);
        t.push(Target {
            name: "idle wake-up latency p99".into(),
            goal: "< 50 ms".into(),
            measured: w.map_or("not measured".into(), |p| {
                format!("{:.1} ms", p.wakeup.p99_ms)
            }),
            met: w.map(|p| p.wakeup.p99_ms < 50.0 && p.wakeup_missing == 0),
        });
        let l = self.latency_at(1000, Runner::Relay { listen: true });
        t.push(Target {
            name: "latency at 1,000/s with LISTEN (p50, p99)".into(),
            goal: "< 2 ms, < 5 ms".into(),
            measured: l.map_or("not measured".into(), |l| {
                format!("{:.1} ms, {:.1} ms", l.summary.p50_ms, l.summary.p99_ms)
            }),
            met: l.map(|l| l.summary.p50_ms < 2.0 && l.summary.p99_ms < 5.0 && l.missing == 0),
        });
        t.extend(self.steady_targets());
        let best = self.best_ceiling();
        t.push(Target {
            name: "drain rate vs the best broker ceiling (1, 2 or 4 channels, from the sweep)"
                .into(),
            goal: ">= 0.90".into(),
            measured: match (ok(&self.drain), best) {
                (Some(d), Some((channels, rate))) => format!(
                    "{:.2} ({} events/s against {} with {channels} channel{})",
                    d.rate / rate,
                    thousands(d.rate),
                    thousands(rate),
                    if channels == 1 { "" } else { "s" }
                ),
                _ => "not measured".into(),
            },
            met: ok(&self.drain)
                .zip(best)
                .map(|(d, (_, rate))| d.rate / rate >= 0.90),
        });
        let g = ok(&self.growth).map(Growth::ratio);
        t.push(Target {
            name: "drain rate with 5M dispatched rows vs empty table".into(),
            goal: ">= 0.95".into(),
            measured: g.map_or("not measured".into(), |r| {
                format!(
                    "{r:.2} ({} rows)",
                    thousands(ok(&self.growth).map_or(0, |g| g.history_rows) as f64)
                )
            }),
            met: g.map(|r| r >= 0.95),
        });
        let m = self.peak_rss_mb();
        t.push(Target {
            name: "relay peak RSS during drains".into(),
            goal: "< 50 MB".into(),
            measured: m.map_or("not measured".into(), |m| format!("{m:.1} MiB")),
            met: m.map(|m| m < 50.0),
        });
        t
    }

    /// The steady-state targets: at 500/s an absolute latency; at every rate latency and
    /// Postgres CPU per event against the yardstick's, and the producers' INSERT against
    /// their INSERT with no relay running.
    fn steady_targets(&self) -> Vec<Target> {
        let ours = Runner::Relay { listen: true };
        let mut t = Vec::new();
        let l = self.latency_at(500, ours);
        t.push(Target {
            name: "latency at 500/s with LISTEN (p50, p99)".into(),
            goal: "< 1.2 ms, < 3 ms".into(),
            measured: l.map_or("not measured".into(), |l| {
                format!("{:.2} ms, {:.2} ms", l.summary.p50_ms, l.summary.p99_ms)
            }),
            met: l.map(|l| l.summary.p50_ms < 1.2 && l.summary.p99_ms < 3.0 && l.missing == 0),
        });
        for l in self.latency_runs(ours) {
            let rate = thousands(l.target_rate as f64);
            let share = STAGES.iter().position(|(name, _, _)| *name == RELAY_SHARE);
            if let (Some(b), Some(i)) = (&l.stages, share) {
                let share = &b.stages[i];
                let floor = l.floor.as_ref().map_or(String::new(), |f| {
                    format!(
                        " (floor: broker hop {:.2} / {:.2} ms, wake-up hop {:.2} / {:.2} ms)",
                        f.broker.p50_ms, f.broker.p99_ms, f.wakeup.p50_ms, f.wakeup.p99_ms
                    )
                });
                t.push(Target {
                    name: format!("relay's own share, commit → published, at {rate}/s (p50, p99)"),
                    goal: "<= 0.5 ms, <= 2 ms".into(),
                    measured: format!("{:.2} ms, {:.2} ms{floor}", share.p50_ms, share.p99_ms),
                    met: Some(share.p50_ms <= 0.5 && share.p99_ms <= 2.0 && l.missing == 0),
                });
            }
            if let Some(y) = self.latency_at(l.target_rate, Runner::Yardstick) {
                let (p50, p99) = (
                    l.summary.p50_ms / y.summary.p50_ms,
                    l.summary.p99_ms / y.summary.p99_ms,
                );
                t.push(Target {
                    name: format!("latency at {rate}/s vs the yardstick's (p50, p99)"),
                    goal: "< 1.00, < 1.00".into(),
                    measured: format!("{p50:.2}, {p99:.2}"),
                    met: Some(p50 < 1.0 && p99 < 1.0 && l.missing == 0),
                });
                let cpu = |x: &Latency| x.load.per_event(x.load.pg_cpu_s()) * 1e6;
                let r = cpu(l) / cpu(y);
                t.push(Target {
                    name: format!("Postgres CPU per event at {rate}/s vs the yardstick's"),
                    goal: "<= 1.00".into(),
                    measured: format!("{r:.2} ({:.0} µs against {:.0} µs)", cpu(l), cpu(y)),
                    met: Some(r <= 1.0),
                });
            }
            if let Some(b) = self.latency_at(l.target_rate, Runner::NoRelay) {
                let r = l.insert.p50_ms / b.insert.p50_ms;
                t.push(Target {
                    name: format!("producers' INSERT p50 at {rate}/s, relay running vs none"),
                    goal: "<= 1.10".into(),
                    measured: format!(
                        "{r:.2} ({:.2} ms against {:.2} ms)",
                        l.insert.p50_ms, b.insert.p50_ms
                    ),
                    met: Some(r <= 1.10),
                });
            }
        }
        t
    }

    /// The highest broker ceiling of the sweep's channel counts (the mean of that count's
    /// ceilings): `(channels, events/s)`.
    fn best_ceiling(&self) -> Option<(usize, f64)> {
        let sw = ok(&self.sweep)?;
        self.settings
            .sweep_channels
            .iter()
            .filter_map(|c| {
                let rates: Vec<f64> = sw
                    .points
                    .iter()
                    .filter(|p| p.channels == *c)
                    .map(|p| p.ceiling.rate)
                    .collect();
                (!rates.is_empty()).then(|| (*c, rates.iter().sum::<f64>() / rates.len() as f64))
            })
            .max_by(|a, b| a.1.total_cmp(&b.1))
    }

    /// The sweep as a line chart, when the sweep ran.
    pub fn svg(&self) -> Option<String> {
        let sw = ok(&self.sweep)?;
        let categories: Vec<String> = self
            .settings
            .sweep_batches
            .iter()
            .map(|b| b.to_string())
            .collect();
        let series: Vec<svg::Series> = self
            .settings
            .sweep_channels
            .iter()
            .map(|c| {
                let mine: Vec<(usize, &crate::sections::SweepPoint)> = self
                    .settings
                    .sweep_batches
                    .iter()
                    .enumerate()
                    .filter_map(|(i, b)| {
                        sw.points
                            .iter()
                            .find(|p| p.batch_size == *b && p.channels == *c)
                            .map(|p| (i, p))
                    })
                    .collect();
                svg::Series {
                    label: format!("{c} channel{}", if *c == 1 { "" } else { "s" }),
                    points: mine.iter().map(|(i, p)| (*i, p.drain.rate)).collect(),
                    reference: mine.iter().map(|(i, p)| (*i, p.ceiling.rate)).collect(),
                }
            })
            .collect();
        Some(svg::line_chart(
            &format!(
                "outbox-relay drain rate, {} events (confirm window {})",
                thousands(sw.events as f64),
                self.settings.relay.confirm_window
            ),
            "batch size (rows per claim)",
            "events/s",
            &categories,
            &series,
        ))
    }
}
