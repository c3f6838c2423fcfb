//! What a run found, as a Markdown table (stdout, pasteable into BENCHMARKS.md) and as
//! JSON (`--json`), with the issue-6 targets and how far each is. Every comparison is a
//! ratio of two figures measured in this run: absolute numbers on a shared 2-core machine
//! move from run to run, ratios much less.

use std::fmt::Write;

use serde_json::{Value, json};

use crate::amqp::Ceiling;
use crate::procfs::CpuSplit;
use crate::sections::{CeilingRuns, Drain, Growth, Latency, ProducerCost, Scale, Settings, Sweep};
use crate::stats::round3;
use crate::svg;

/// A section's outcome: not run (`None`), measured, or failed with a message.
pub type Outcome<T> = Option<Result<T, String>>;

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
}

/// One issue-6 target and how far the run is from it.
pub struct Target {
    pub name: &'static str,
    pub goal: String,
    pub measured: String,
    pub met: Option<bool>,
}

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

fn ok<T>(o: &Outcome<T>) -> Option<&T> {
    o.as_ref().and_then(|r| r.as_ref().ok())
}

fn mb(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

impl Results {
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
        out
    }

    fn drain_ratio(&self) -> Option<f64> {
        Some(ok(&self.drain)?.rate / ok(&self.ceiling)?.rate())
    }

    fn busy_ratio(&self) -> Option<f64> {
        ok(&self.producer)?.busy_ratio()
    }

    fn latency_at(&self, rate: u64, listen: bool) -> Option<&Latency> {
        ok(&self.latency)?
            .iter()
            .find(|l| l.target_rate == rate && l.listen == listen)
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

    pub fn targets(&self) -> Vec<Target> {
        let yes = |b: bool| Some(b);
        let mut t = Vec::new();
        let dr = self.drain_ratio();
        t.push(Target {
            name: "drain rate vs broker ceiling",
            goal: ">= 0.90".into(),
            measured: dr.map_or("not measured".into(), |r| format!("{r:.2}")),
            met: dr.and_then(|r| yes(r >= 0.90)),
        });
        let br = self.busy_ratio();
        t.push(Target {
            name: "producer commits/s, relay busy, vs table without triggers",
            goal: ">= 0.90".into(),
            measured: br.map_or("not measured".into(), |r| format!("{r:.2}")),
            met: br.and_then(|r| yes(r >= 0.90)),
        });
        let w = ok(&self.producer).filter(|p| p.wakeup.count > 0);
        t.push(Target {
            name: "idle wake-up latency p99",
            goal: "< 50 ms".into(),
            measured: w.map_or("not measured".into(), |p| {
                format!("{:.1} ms", p.wakeup.p99_ms)
            }),
            met: w.map(|p| p.wakeup.p99_ms < 50.0 && p.wakeup_missing == 0),
        });
        let l = self.latency_at(1000, true);
        t.push(Target {
            name: "latency at 1,000/s with LISTEN (p50, p99)",
            goal: "< 2 ms, < 5 ms".into(),
            measured: l.map_or("not measured".into(), |l| {
                format!("{:.1} ms, {:.1} ms", l.summary.p50_ms, l.summary.p99_ms)
            }),
            met: l.map(|l| l.summary.p50_ms < 2.0 && l.summary.p99_ms < 5.0 && l.missing == 0),
        });
        let g = ok(&self.growth).map(Growth::ratio);
        t.push(Target {
            name: "drain rate with 5M dispatched rows vs empty table",
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
            name: "relay peak RSS during drains",
            goal: "< 50 MB".into(),
            measured: m.map_or("not measured".into(), |m| format!("{m:.1} MiB")),
            met: m.map(|m| m < 50.0),
        });
        t
    }

    /// The Markdown report printed on stdout.
    pub fn markdown(&self) -> String {
        let s = &self.settings;
        let mut o = String::new();
        let mode = if s.smoke {
            "smoke (tiny sizes: the figures mean nothing)"
        } else {
            "full"
        };
        let _ = writeln!(o, "## outbox-bench: {mode}\n");
        let _ = writeln!(
            o,
            "Machine: {} cores ({}), {:.0} GiB, Linux {}, {}; load average at start {}. \
             Shared and noisy: compare the ratios, not the absolute rates.\n",
            self.machine.cores,
            self.machine.cpu_model,
            self.machine.memory_gib,
            self.machine.kernel,
            self.machine.postgres,
            self.machine.load_at_start
        );
        let _ = writeln!(
            o,
            "Relay: {}. Events: about {} bytes of JSON, {} keys. Run took {:.0} s.\n",
            s.relay.describe(),
            ok(&self.drain).map_or(500.0, |d| d.payload_bytes).round(),
            thousands(s.keys as f64),
            self.duration_s
        );
        let _ = writeln!(o, "| # | measurement | figure | value | ratio |");
        let _ = writeln!(o, "|---|---|---|---|---|");
        let mut row = |n: &str, m: &str, f: &str, v: String, r: String| {
            let _ = writeln!(o, "| {n} | {m} | {f} | {v} | {r} |");
        };
        let ceiling = ok(&self.ceiling).map(CeilingRuns::rate);
        match &self.ceiling {
            Some(Ok(cr)) => {
                let c = cr.first();
                let runs: Vec<String> = cr.runs.iter().map(|c| thousands(c.rate)).collect();
                row(
                    "1",
                    "broker ceiling",
                    &format!(
                        "publish + confirm, no database, {} channels, window {}, {:.0}-byte body, persistent; mean of the runs before and after (2)",
                        c.channels, c.window, c.body_bytes
                    ),
                    format!("{} events/s ({})", thousands(cr.rate()), runs.join(", ")),
                    "1.00".into(),
                )
            }
            Some(Err(e)) => row("1", "broker ceiling", "FAILED", e.clone(), String::new()),
            None => {}
        }
        let of_ceiling = |r: f64| ceiling.map_or(String::new(), |c| format!("{:.2} of (1)", r / c));
        match &self.drain {
            Some(Ok(d)) => {
                row(
                    "2",
                    "backlog drain",
                    &format!(
                        "{} events, {} keys: relay start to all dispatched and queued",
                        thousands(d.events as f64),
                        thousands(s.keys as f64)
                    ),
                    format!("{} events/s ({:.1} s)", thousands(d.rate), d.seconds),
                    of_ceiling(d.rate),
                );
                row(
                    "2",
                    "",
                    "first to last dispatched_at (start-up excluded)",
                    format!("{} events/s", thousands(d.steady_rate)),
                    of_ceiling(d.steady_rate),
                );
                row(
                    "2",
                    "",
                    "relay start to first row dispatched",
                    format!("{:.2} s", d.startup_s),
                    String::new(),
                );
            }
            Some(Err(e)) => row("2", "backlog drain", "FAILED", e.clone(), String::new()),
            None => {}
        }
        match &self.latency {
            Some(Ok(runs)) => {
                for l in runs {
                    row(
                        "3",
                        &format!(
                            "latency at {}/s, {}",
                            thousands(l.target_rate as f64),
                            if l.listen {
                                "LISTEN".to_owned()
                            } else {
                                format!("--no-listen (poll {})", l.poll_interval)
                            }
                        ),
                        "commit returned to consumer arrival: p50 / p99 / max",
                        format!(
                            "{:.1} / {:.1} / {:.1} ms",
                            l.summary.p50_ms, l.summary.p99_ms, l.summary.max_ms
                        ),
                        format!(
                            "achieved {}/s, {} samples{}",
                            thousands(l.achieved_rate),
                            thousands(l.summary.count as f64),
                            if l.missing > 0 {
                                format!(", {} not arrived 30 s after the last commit", l.missing)
                            } else {
                                String::new()
                            }
                        ),
                    );
                    let windows: Vec<String> =
                        l.p50_by_5s.iter().map(|x| format!("{x:.0}")).collect();
                    row(
                        "3",
                        "",
                        "p50 per 5 s of the run (ms); Postgres",
                        windows.join(" → "),
                        format!(
                            "{} claims, {:.1} ms and {:.0} pending-index blocks each; {} dead rows at the end, {} autovacuums",
                            thousands(l.pg.claim_calls as f64),
                            l.pg.claim_ms / l.pg.claim_calls.max(1) as f64,
                            l.pg.pending_idx_blks as f64 / l.pg.claim_calls.max(1) as f64,
                            thousands(l.pg.dead_tup as f64),
                            l.pg.autovacuums
                        ),
                    );
                }
            }
            Some(Err(e)) => row("3", "latency", "FAILED", e.clone(), String::new()),
            None => {}
        }
        match &self.producer {
            Some(Ok(p)) => {
                for r in &p.runs {
                    let base = if r.id == "outbox_relay_busy" {
                        format!("{:.2} of plain, relay busy", r.tx_per_s / p.baseline_of(r))
                    } else {
                        format!("{:.2} of plain", r.tx_per_s / p.baseline_of(r))
                    };
                    let notes = match r.notifies {
                        Some(n) => format!(
                            "{} tx/s ({:.2} NOTIFY/tx)",
                            thousands(r.tx_per_s),
                            n as f64 / r.commits.max(1) as f64
                        ),
                        None => format!("{} tx/s", thousands(r.tx_per_s)),
                    };
                    row(
                        "4",
                        &format!("producers ({} connections)", p.producers),
                        &match r.round {
                            Some(n) => format!("{} (pair {n})", r.what),
                            None => r.what.to_owned(),
                        },
                        notes,
                        base,
                    );
                }
                if let Some(median) = p.busy_ratio() {
                    row(
                        "4",
                        "producers, relay busy",
                        "outbox_events against the table without triggers: median of the pairs",
                        p.busy_ratios()
                            .iter()
                            .map(|r| format!("{r:.2}"))
                            .collect::<Vec<_>>()
                            .join(", "),
                        format!("{median:.2}"),
                    );
                }
                row(
                    "4",
                    "idle wake-up",
                    "one event every ~100 ms, commit to arrival: p50 / p99 / max",
                    format!(
                        "{:.1} / {:.1} / {:.1} ms",
                        p.wakeup.p50_ms, p.wakeup.p99_ms, p.wakeup.max_ms
                    ),
                    format!(
                        "{} samples{}",
                        p.wakeup.count,
                        if p.wakeup_missing > 0 {
                            format!(", {} not arrived within 30 s", p.wakeup_missing)
                        } else {
                            String::new()
                        }
                    ),
                );
                if !p.busy_throughout {
                    row(
                        "4",
                        "",
                        "WARNING",
                        "the relay ran out of backlog during the busy runs".into(),
                        String::new(),
                    );
                }
            }
            Some(Err(e)) => row("4", "producer cost", "FAILED", e.clone(), String::new()),
            None => {}
        }
        match &self.growth {
            Some(Ok(g)) => {
                row(
                    "5",
                    "growth",
                    &format!(
                        "drain with {} dispatched rows in the table (made in {:.0} s)",
                        thousands(g.history_rows as f64),
                        g.history_s
                    ),
                    format!(
                        "{} events/s (rounds: {})",
                        thousands(g.loaded_rate()),
                        g.loaded
                            .iter()
                            .map(|d| thousands(d.rate))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                    format!(
                        "{:.2} of empty table ({} events/s; rounds: {})",
                        g.ratio(),
                        thousands(g.empty_rate()),
                        g.empty
                            .iter()
                            .map(|d| thousands(d.rate))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                );
                if let (Some((d, deleted)), Some(r)) = (&g.retained, g.retained_ratio()) {
                    row(
                        "5",
                        "",
                        &format!(
                            "the same with --retention 1h deleting those rows meanwhile ({} deleted by the end of the drain)",
                            thousands(*deleted as f64)
                        ),
                        format!("{} events/s", thousands(d.rate)),
                        format!("{r:.2} of empty table"),
                    );
                }
                row(
                    "5",
                    "",
                    "Postgres, empty table (round 1)",
                    pg_line(&g.empty[0]),
                    String::new(),
                );
                row(
                    "5",
                    "",
                    "Postgres, with the dispatched rows (round 1)",
                    pg_line(&g.loaded[0]),
                    String::new(),
                );
            }
            Some(Err(e)) => row("5", "growth", "FAILED", e.clone(), String::new()),
            None => {}
        }
        if let Some(d) = ok(&self.drain) {
            row(
                "6",
                "relay resources (drain 2)",
                "peak RSS (VmHWM)",
                format!("{:.1} MiB", mb(d.usage.peak_rss_kib)),
                String::new(),
            );
            row(
                "6",
                "",
                "relay CPU per 100,000 events",
                format!("{:.2} s", d.cpu_per_100k(d.cpu.relay)),
                String::new(),
            );
        }
        if let Some(g) = ok(&self.growth) {
            row(
                "6",
                "relay resources (drain 5)",
                "peak RSS / CPU per 100,000 events",
                format!(
                    "{:.1} MiB / {:.2} s",
                    mb(g.loaded[0].usage.peak_rss_kib),
                    g.loaded[0].cpu_per_100k(g.loaded[0].cpu.relay)
                ),
                String::new(),
            );
        }
        o.push('\n');

        if let Some(d) = ok(&self.drain) {
            let _ = writeln!(o, "Where the CPU went during the drain (2):\n");
            o.push_str(&cpu_table(d, ok(&self.ceiling).map(CeilingRuns::first)));
            o.push('\n');
            let _ = writeln!(o, "Postgres during the drain (2): {}.\n", pg_line(d));
        }

        let _ = writeln!(o, "Issue-6 targets:\n");
        let _ = writeln!(o, "| target | goal | measured | met |");
        let _ = writeln!(o, "|---|---|---|---|");
        for t in self.targets() {
            let met = match t.met {
                Some(true) => "yes",
                Some(false) => "NO",
                None => "-",
            };
            let _ = writeln!(o, "| {} | {} | {} | {met} |", t.name, t.goal, t.measured);
        }
        o.push('\n');

        if let Some(sc) = ok(&self.scale) {
            let _ = writeln!(
                o,
                "Scale-out: a backlog of {} events drained by several relays started together (each next to a fresh broker ceiling):\n",
                thousands(sc.events as f64)
            );
            let _ = writeln!(
                o,
                "| relays | drain events/s | broker ceiling | ratio to ceiling | ratio to one relay | duplicates |"
            );
            let _ = writeln!(o, "|---|---|---|---|---|---|");
            let one = sc.points.iter().find(|p| p.relays == 1).map(|p| p.ratio());
            for p in &sc.points {
                let _ = writeln!(
                    o,
                    "| {} | {} | {} | {:.2} | {} | {} |",
                    p.relays,
                    thousands(p.rate),
                    thousands(p.ceiling.rate),
                    p.ratio(),
                    one.map_or("-".into(), |r| format!("{:.2}", p.ratio() / r)),
                    p.duplicates
                );
            }
            o.push('\n');
        }
        if let Some(sw) = ok(&self.sweep) {
            let _ = writeln!(
                o,
                "Sweep: drain rate of {} events / broker ceiling with the same channels measured just before it (ratio), events/s:\n",
                thousands(sw.events as f64)
            );
            let _ = write!(o, "| batch size |");
            for c in &s.sweep_channels {
                let _ = write!(o, " {c} channel{} |", if *c == 1 { "" } else { "s" });
            }
            let _ = write!(o, "\n|---|");
            for _ in &s.sweep_channels {
                let _ = write!(o, "---|");
            }
            o.push('\n');
            for b in &s.sweep_batches {
                let _ = write!(o, "| {b} |");
                for c in &s.sweep_channels {
                    match sw
                        .points
                        .iter()
                        .find(|p| p.batch_size == *b && p.channels == *c)
                    {
                        Some(p) => {
                            let _ = write!(
                                o,
                                " {} / {} ({:.2}) |",
                                thousands(p.drain.rate),
                                thousands(p.ceiling.rate),
                                p.ratio()
                            );
                        }
                        None => o.push_str(" - |"),
                    }
                }
                o.push('\n');
            }
            o.push('\n');
        }
        for (section, e) in self.errors() {
            let _ = writeln!(o, "ERROR in {section}: {e}");
        }
        o
    }

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

    pub fn json(&self) -> Value {
        let s = &self.settings;
        let section = |o: &Outcome<Value>| match o {
            None => Value::Null,
            Some(Ok(v)) => v.clone(),
            Some(Err(e)) => json!({ "error": e }),
        };
        let ceiling = self.ceiling.as_ref().map(|r| {
            r.as_ref()
                .map(|cr| {
                    let mut v = ceiling_json(cr.first());
                    v["rate"] = json!(cr.rate().round());
                    v["runs"] = cr.runs.iter().map(ceiling_json).collect();
                    v
                })
                .map_err(Clone::clone)
        });
        let drain = self.drain.as_ref().map(|r| {
            r.as_ref()
                .map(|d| {
                    let mut v = drain_json(d);
                    if let Some(c) = ok(&self.ceiling) {
                        v["ratio_to_ceiling"] = json!(round3(d.rate / c.rate()));
                        v["steady_ratio_to_ceiling"] = json!(round3(d.steady_rate / c.rate()));
                    }
                    v
                })
                .map_err(Clone::clone)
        });
        let latency = self.latency.as_ref().map(|r| {
            r.as_ref()
                .map(|runs| {
                    json!({ "runs": runs.iter().map(|l| json!({
                        "target_rate": l.target_rate,
                        "listen": l.listen,
                        "poll_interval": l.poll_interval,
                        "achieved_rate": l.achieved_rate.round(),
                        "warmup_events": l.warmup_events,
                        "latency": l.summary.json(),
                        "missing": l.missing,
                        "arrived_before_commit_returned": l.arrived_before_commit_returned,
                        "p50_ms_by_5s": l.p50_by_5s.iter().map(|x| round3(*x)).collect::<Vec<_>>(),
                        "postgres": {
                            "claims": l.pg.claim_calls,
                            "claim_ms_mean": round3(l.pg.claim_ms / l.pg.claim_calls.max(1) as f64),
                            "pending_index_blocks_per_claim": round3(l.pg.pending_idx_blks as f64 / l.pg.claim_calls.max(1) as f64),
                            "transactions": l.pg.xact_commit,
                            "dead_tuples_at_end": l.pg.dead_tup,
                            "autovacuums": l.pg.autovacuums,
                        },
                    })).collect::<Vec<_>>() })
                })
                .map_err(Clone::clone)
        });
        let producer = self.producer.as_ref().map(|r| {
            r.as_ref()
                .map(|p| {
                    json!({
                        "producers": p.producers,
                        "seconds_per_run": p.seconds,
                        "runs": p.runs.iter().map(|r| json!({
                            "id": r.id,
                            "what": r.what,
                            "tx_per_s": r.tx_per_s.round(),
                            "commits": r.commits,
                            "notifies": r.notifies,
                            "round": r.round,
                            "ratio_to_baseline": round3(r.tx_per_s / p.baseline_of(r)),
                        })).collect::<Vec<_>>(),
                        "plain_baseline_tx_per_s": p.plain().round(),
                        "ratio_busy_to_plain_busy": p.busy_ratio().map(round3),
                        "ratios_busy_to_plain_busy_per_pair": p.busy_ratios().iter().copied().map(round3).collect::<Vec<_>>(),
                        "busy_throughout": p.busy_throughout,
                        "busy_backlog_events": p.busy_backlog,
                        "idle_wakeup": p.wakeup.json(),
                        "idle_wakeup_missing": p.wakeup_missing,
                    })
                })
                .map_err(Clone::clone)
        });
        let growth = self.growth.as_ref().map(|r| {
            r.as_ref()
                .map(|g| {
                    json!({
                        "history_rows": g.history_rows,
                        "history_insert_s": round3(g.history_s),
                        "rounds": g.loaded.len(),
                        "loaded_rate": g.loaded_rate().round(),
                        "empty_rate": g.empty_rate().round(),
                        "empty": g.empty.iter().map(drain_json).collect::<Vec<_>>(),
                        "loaded": g.loaded.iter().map(drain_json).collect::<Vec<_>>(),
                        "ratio": round3(g.ratio()),
                        "with_retention": g.retained.as_ref().map(|(d, deleted)| json!({
                            "drain": drain_json(d),
                            "deleted_during_drain": deleted,
                            "ratio": g.retained_ratio().map(round3),
                        })),
                    })
                })
                .map_err(Clone::clone)
        });
        let resources = ok(&self.drain).map(|d| {
            json!({
                "peak_rss_mib": round3(mb(d.usage.peak_rss_kib)),
                "peak_rss_mib_all_drains": self.peak_rss_mb().map(round3),
                "relay_cpu_s_per_100k_events": round3(d.cpu_per_100k(d.cpu.relay)),
                "postgres_cpu_s_per_100k_events": round3(d.cpu_per_100k(d.cpu.postgres_bench_db + d.cpu.postgres_other)),
                "rabbitmq_cpu_s_per_100k_events": round3(d.cpu_per_100k(d.cpu.rabbitmq)),
            })
        });
        let resources = match (&self.drain, resources) {
            (_, Some(v)) => Some(Ok(v)),
            (Some(Err(e)), None) => Some(Err(e.clone())),
            _ => None,
        };
        let sweep = self.sweep.as_ref().map(|r| {
            r.as_ref()
                .map(|sw| {
                    json!({
                        "events": sw.events,
                        "points": sw.points.iter().map(|p| {
                            json!({
                                "batch_size": p.batch_size,
                                "channels": p.channels,
                                "rate": p.drain.rate.round(),
                                "ceiling_rate": p.ceiling.rate.round(),
                                "ratio_to_ceiling": round3(p.ratio()),
                                "peak_rss_mib": round3(mb(p.drain.usage.peak_rss_kib)),
                            })
                        }).collect::<Vec<_>>(),
                    })
                })
                .map_err(Clone::clone)
        });
        let scale = self.scale.as_ref().map(|r| {
            r.as_ref()
                .map(|sc| {
                    json!({
                        "events": sc.events,
                        "points": sc.points.iter().map(|p| {
                            json!({
                                "relays": p.relays,
                                "seconds": round3(p.seconds),
                                "rate": p.rate.round(),
                                "ceiling_rate": p.ceiling.rate.round(),
                                "ratio_to_ceiling": round3(p.ratio()),
                                "duplicates": p.duplicates,
                            })
                        }).collect::<Vec<_>>(),
                    })
                })
                .map_err(Clone::clone)
        });
        json!({
            "bench": "outbox-bench",
            "format": 1,
            "mode": if s.smoke { "smoke" } else { "full" },
            "started_unix": self.started_unix.round(),
            "duration_s": round3(self.duration_s),
            "machine": {
                "cores": self.machine.cores,
                "memory_gib": round3(self.machine.memory_gib),
                "cpu_model": self.machine.cpu_model,
                "kernel": self.machine.kernel,
                "postgres": self.machine.postgres,
                "load_average_at_start": self.machine.load_at_start,
            },
            "settings": {
                "events": s.events,
                "keys": s.keys,
                "relay": {
                    "batch_size": s.relay.batch_size,
                    "channels": s.relay.channels,
                    "confirm_window": s.relay.confirm_window,
                    "poll_interval": s.relay.poll_interval,
                },
                "latency_rates": s.latency_rates,
                "latency_secs": s.latency_secs,
                "latency_producers": s.latency_producers,
                "producers": s.producers,
                "producer_secs": s.producer_secs,
                "wakeup_samples": s.wakeup_samples,
                "growth_rows": s.growth_rows,
                "sweep_batches": s.sweep_batches,
                "sweep_channels": s.sweep_channels,
                "sweep_events": s.sweep_events,
                "scale_relays": s.scale_relays,
                "scale_events": s.scale_events,
            },
            "broker_ceiling": section(&ceiling),
            "drain": section(&drain),
            "latency": section(&latency),
            "producer_cost": section(&producer),
            "growth": section(&growth),
            "relay_resources": section(&resources),
            "sweep": section(&sweep),
            "scale_out": section(&scale),
            "targets": self.targets().iter().map(|t| json!({
                "name": t.name, "goal": t.goal, "measured": t.measured, "met": t.met,
            })).collect::<Vec<_>>(),
            "errors": self.errors().iter().map(|(s, e)| json!({"section": s, "error": e})).collect::<Vec<_>>(),
        })
    }
}

fn ceiling_json(c: &Ceiling) -> Value {
    json!({
        "cpu": cpu_json(&c.cpu, c.messages),
        "messages": c.messages,
        "seconds": round3(c.seconds),
        "rate": c.rate.round(),
        "channels": c.channels,
        "confirm_window": c.window,
        "body_bytes": c.body_bytes.round(),
    })
}

fn drain_json(d: &Drain) -> Value {
    json!({
        "events": d.events,
        "batch_size": d.settings.batch_size,
        "channels": d.settings.channels,
        "seconds": round3(d.seconds),
        "rate": d.rate.round(),
        "steady_rate": d.steady_rate.round(),
        "startup_s": round3(d.startup_s),
        "payload_bytes": d.payload_bytes.round(),
        "relay_peak_rss_mib": round3(mb(d.usage.peak_rss_kib)),
        "relay_rss_at_end_mib": round3(mb(d.usage.rss_kib)),
        "relay_cpu_s": round3(d.usage.cpu_s),
        "cpu": cpu_json(&d.cpu, d.events),
        "postgres": pg_json(d),
    })
}

fn pg_json(d: &Drain) -> Value {
    let p = &d.pg;
    let per = |x: f64| round3(x * 100_000.0 / d.events as f64);
    json!({
        "claims": p.claim_calls,
        "rows_per_claim": round3(d.events as f64 / p.claim_calls.max(1) as f64),
        "claim_ms_total": round3(p.claim_ms),
        "claim_ms_mean": round3(p.claim_ms / p.claim_calls.max(1) as f64),
        "transactions": p.xact_commit,
        "row_updates": p.tup_upd,
        "hot_updates": p.tup_hot_upd,
        "heap_blocks_read": p.heap_blks_read,
        "heap_blocks_hit": p.heap_blks_hit,
        "index_blocks_read": p.idx_blks_read,
        "index_blocks_hit": p.idx_blks_hit,
        "checkpoints_started": p.checkpoints,
        "wal_bytes": p.wal_bytes,
        "wal_full_page_images": p.wal_fpi,
        "per_100k_events": {
            "claim_s": per(p.claim_ms / 1000.0),
            "transactions": per(p.xact_commit as f64),
            "row_updates": per(p.tup_upd as f64),
            "index_blocks_read": per(p.idx_blks_read as f64),
            "index_blocks_hit": per(p.idx_blks_hit as f64),
            "wal_bytes": per(p.wal_bytes as f64),
            "wal_full_page_images": per(p.wal_fpi as f64),
        },
    })
}

/// One line on what Postgres did for a drain.
fn pg_line(d: &Drain) -> String {
    let p = &d.pg;
    let per = |x: f64| x * 100_000.0 / d.events as f64;
    format!(
        "{} claims ({:.0} rows each, {:.1} ms each inside outbox_claim, {:.1} s per 100,000 events); \
         {} transactions; {} row updates ({:.0}% HOT, {:.1} per event); index blocks per 100,000 events: \
         {} read from outside shared_buffers, {} hit; WAL {:.1} KiB per event ({} full-page images per 100,000 events), \
         {} checkpoints started",
        thousands(p.claim_calls as f64),
        d.events as f64 / p.claim_calls.max(1) as f64,
        p.claim_ms / p.claim_calls.max(1) as f64,
        per(p.claim_ms / 1000.0),
        thousands(p.xact_commit as f64),
        thousands(p.tup_upd as f64),
        100.0 * p.tup_hot_upd as f64 / p.tup_upd.max(1) as f64,
        p.tup_upd as f64 / d.events as f64,
        thousands(per(p.idx_blks_read as f64)),
        thousands(per(p.idx_blks_hit as f64)),
        p.wal_bytes as f64 / 1024.0 / d.events as f64,
        thousands(per(p.wal_fpi as f64)),
        p.checkpoints,
    )
}

fn cpu_json(c: &CpuSplit, events: u64) -> Value {
    let per = |x: f64| round3(x * 100_000.0 / events as f64);
    json!({
        "wall_s": round3(c.wall_s),
        "machine_busy_fraction": round3(c.machine_busy_frac),
        "seconds": {
            "relay": round3(c.relay),
            "postgres_bench_db": round3(c.postgres_bench_db),
            "postgres_other": round3(c.postgres_other),
            "rabbitmq": round3(c.rabbitmq),
            "bench": round3(c.bench),
            "other": round3(c.other),
        },
        "seconds_per_100k_events": {
            "relay": per(c.relay),
            "postgres_bench_db": per(c.postgres_bench_db),
            "postgres_other": per(c.postgres_other),
            "rabbitmq": per(c.rabbitmq),
        },
    })
}

/// Where the CPU went during the drain, next to the same split while the broker ceiling
/// was measured (per 100,000 messages): what the relay and Postgres add to the broker's work.
fn cpu_table(d: &Drain, ceiling: Option<&Ceiling>) -> String {
    let c = &d.cpu;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let capacity = c.wall_s * cores;
    let per = |v: f64, n: u64| v * 100_000.0 / n.max(1) as f64;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "| process | drain (2): CPU s | per 100,000 events | share of the machine ({:.1} s x {cores} cores) | ceiling (1): CPU s per 100,000 messages |",
        c.wall_s
    );
    let _ = writeln!(o, "|---|---|---|---|---|");
    let cc = ceiling.map(|x| (&x.cpu, x.messages));
    for (name, v, cv) in [
        ("outbox-relay", c.relay, cc.map(|(x, _)| x.relay)),
        (
            "postgres backends of the bench database",
            c.postgres_bench_db,
            cc.map(|(x, _)| x.postgres_bench_db),
        ),
        (
            "postgres background and other databases",
            c.postgres_other,
            cc.map(|(x, _)| x.postgres_other),
        ),
        (
            "rabbitmq (beam.smp)",
            c.rabbitmq,
            cc.map(|(x, _)| x.rabbitmq),
        ),
        (
            "outbox-bench itself (polling; publishing in (1))",
            c.bench,
            cc.map(|(x, _)| x.bench),
        ),
        (
            "everything else (other users of the machine)",
            c.other,
            cc.map(|(x, _)| x.other),
        ),
    ] {
        let ceiling_cell = match (cv, cc) {
            (Some(v), Some((_, n))) => format!("{:.2}", per(v, n)),
            _ => "-".into(),
        };
        let _ = writeln!(
            o,
            "| {name} | {v:.2} | {:.2} | {:.0}% | {ceiling_cell} |",
            d.cpu_per_100k(v),
            100.0 * v / capacity.max(1e-9)
        );
    }
    let _ = writeln!(
        o,
        "| machine busy | | | {:.0}% | {} |",
        100.0 * c.machine_busy_frac,
        cc.map_or("-".into(), |(x, _)| format!(
            "{:.0}% busy",
            100.0 * x.machine_busy_frac
        ))
    );
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thousands_are_grouped() {
        assert_eq!(thousands(0.0), "0");
        assert_eq!(thousands(999.4), "999");
        assert_eq!(thousands(1000.0), "1,000");
        assert_eq!(thousands(5_000_000.0), "5,000,000");
        assert_eq!(thousands(-1234.0), "-1,234");
    }
}
