//! The JSON report (`--json`): every section's figures, the settings, the machine, the
//! targets and the errors, rounded to three decimals.

use serde_json::{Value, json};

use super::{Outcome, Results, mb, ok};
use crate::amqp::Ceiling;
use crate::procfs::CpuSplit;
use crate::sections::{Drain, Latency, Runner};
use crate::stages::STAGES;
use crate::stats::round3;

impl Results {
    /// The whole run as one JSON document (`format` 1).
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
                    let of = |runner: Runner| -> Vec<Value> {
                        runs.iter()
                            .filter(|l| l.runner == runner)
                            .map(|l| self.latency_json(l))
                            .collect()
                    };
                    let mut ours = of(Runner::Relay { listen: true });
                    ours.extend(of(Runner::Relay { listen: false }));
                    ours.sort_by_key(|v| v["target_rate"].as_u64());
                    json!({
                        "runs": ours,
                        "yardstick_runs": of(Runner::Yardstick),
                        "no_relay_runs": of(Runner::NoRelay),
                    })
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
        let consumer = self.consumer.as_ref().map(|r| {
            r.as_ref()
                .map(|c| {
                    json!({
                        "events": c.events,
                        "keys": c.keys,
                        "partitions": c.partitions,
                        "prefetch": c.prefetch,
                        "drain_rate": c.drain_rate.round(),
                        "drain_events": c.drain_events,
                        "points": c.points.iter().map(|p| {
                            json!({
                                "mode": p.mode.name(),
                                "instances": p.instances,
                                "seconds": round3(p.seconds),
                                "rate": p.rate.round(),
                                "ratio_to_drain": round3(c.ratio(p)),
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
                "consumer_events": s.consumer_events,
                "consumer_keys": s.consumer_keys,
                "consumer_instances": s.consumer_instances,
                "consumer_partitions": s.consumer_partitions,
                "consumer_prefetch": s.consumer_prefetch,
            },
            "broker_ceiling": section(&ceiling),
            "drain": section(&drain),
            "latency": section(&latency),
            "producer_cost": section(&producer),
            "growth": section(&growth),
            "relay_resources": section(&resources),
            "sweep": section(&sweep),
            "scale_out": section(&scale),
            "consumer": section(&consumer),
            "targets": self.targets().iter().map(|t| json!({
                "name": t.name, "goal": t.goal, "measured": t.measured, "met": t.met,
            })).collect::<Vec<_>>(),
            "errors": self.errors().iter().map(|(s, e)| json!({"section": s, "error": e})).collect::<Vec<_>>(),
        })
    }
}

impl Results {
    /// One latency run, with its ratios to the yardstick and to no relay at the same rate.
    fn latency_json(&self, l: &Latency) -> Value {
        let ratio = |a: f64, b: Option<f64>| b.filter(|b| *b > 0.0).map(|b| round3(a / b));
        let yard = self.latency_at(l.target_rate, Runner::Yardstick);
        let bare = self.latency_at(l.target_rate, Runner::NoRelay);
        let d = &l.load;
        let us = |s: f64| round3(d.per_event(s) * 1e6);
        json!({
            "target_rate": l.target_rate,
            "run": l.runner.id(),
            "listen": l.listen(),
            "poll_interval": l.poll_interval,
            "achieved_rate": l.achieved_rate.round(),
            "warmup_events": l.warmup_events,
            "latency": l.summary.json(),
            "p50_ratio_to_yardstick": ratio(l.summary.p50_ms, yard.map(|y| y.summary.p50_ms)),
            "p99_ratio_to_yardstick": ratio(l.summary.p99_ms, yard.map(|y| y.summary.p99_ms)),
            "missing": l.missing,
            "arrived_before_commit_returned": l.arrived_before_commit_returned,
            "p50_ms_by_5s": l.p50_by_5s.iter().map(|x| round3(*x)).collect::<Vec<_>>(),
            "producer_insert": l.insert.json(),
            "producer_insert_p50_ratio_to_no_relay": ratio(l.insert.p50_ms, bare.map(|b| b.insert.p50_ms)),
            "producer_insert_p99_ratio_to_no_relay": ratio(l.insert.p99_ms, bare.map(|b| b.insert.p99_ms)),
            "load": {
                "events": d.events,
                "wall_s": round3(d.wall_s),
                "relay_cpu_us_per_event": us(d.relay_cpu_s),
                "postgres_cpu_us_per_event": us(d.pg_cpu_s()),
                "postgres_relay_backends_cpu_us_per_event": us(d.pg_relay_cpu_s),
                "postgres_producer_backends_cpu_us_per_event": us(d.pg_producers_cpu_s),
                "wal_bytes_per_event": round3(d.per_event(d.wal_bytes)),
            },
            "postgres": {
                "claims": l.pg.claim_calls,
                "claim_ms_mean": round3(l.pg.claim_ms / l.pg.claim_calls.max(1) as f64),
                "pending_index_blocks_per_claim": round3(l.pg.pending_idx_blks as f64 / l.pg.claim_calls.max(1) as f64),
                "transactions": l.pg.xact_commit,
                "dead_tuples_at_end": l.pg.dead_tup,
                "autovacuums": l.pg.autovacuums,
            },
            "floor": l.floor.as_ref().map(|f| json!({
                "broker_hop": f.broker.json(),
                "wakeup_hop": f.wakeup.json(),
            })),
            "stages": l.stages.as_ref().map(|b| json!({
                "events": b.events,
                "events_untraced": b.events_untraced,
                "stages": STAGES.iter().zip(&b.stages).map(|((name, _, _), s)| {
                    let mut v = s.json();
                    v["stage"] = json!(name);
                    v
                }).collect::<Vec<_>>(),
                "claims": b.claims,
                "claims_with_rows": b.claims_with_rows,
                "claims_per_event": round3(b.claims as f64 / b.events.max(1) as f64),
                "rows_per_claim_with_rows": round3(b.claim_rows as f64 / b.claims_with_rows.max(1) as f64),
                "claim_round_trip": b.claim_round_trip.json(),
                "marks": b.marks,
                "marks_per_event": round3(b.marks as f64 / b.events.max(1) as f64),
                "rows_per_mark": round3(b.mark_rows as f64 / b.marks.max(1) as f64),
                "mark_round_trip": b.mark_round_trip.json(),
                "notifies_per_event": round3(b.notifies as f64 / b.events.max(1) as f64),
            })),
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
