//! The binary's log subscriber: `RUST_LOG` (or the command's default) filters, text or JSON
//! goes to stderr, and lapin's targets that print message bodies stay capped whatever
//! `RUST_LOG` says, unless one of its directives names that target.
//!
//! Why the cap: lapin logs every returned message at WARN with its body, and dumps frames
//! (bodies included) at TRACE; with `RUST_LOG=info`, a setting many deployments use, one
//! relay wrote hundreds of users' payloads into its log during a broker restart. The relay
//! reports returns itself, without the body. The targets and their caps are the kit's
//! [`PAYLOAD_LOG_TARGETS`], which services using the consumer kit are told to apply too.

use outbox_kit::amqp::PAYLOAD_LOG_TARGETS;
use tracing::Subscriber;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::SubscriberExt;

use super::LogFormat;

/// Installs the process's subscriber. `rust_log` is `RUST_LOG` as read by `main`; when unset
/// or invalid, `default_filter` applies.
pub fn init(format: LogFormat, default_filter: &str, rust_log: Option<&str>) {
    // Colour only on a terminal: a file, a pipe or a container's log collector gets plain
    // text. NO_COLOR (https://no-color.org) turns colour off on a terminal too.
    use std::io::IsTerminal;
    let ansi = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    let subscriber = subscriber(format, default_filter, rust_log, ansi, std::io::stderr);
    // Only fails if a subscriber was set before, which nothing in this binary does.
    let _ = tracing::subscriber::set_global_default(subscriber);
}

/// The subscriber [`init`] installs, writing to `writer` (tests capture it).
fn subscriber<W>(
    format: LogFormat,
    default_filter: &str,
    rust_log: Option<&str>,
    ansi: bool,
    writer: W,
) -> Box<dyn Subscriber + Send + Sync>
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let filter = rust_log
        .and_then(|r| EnvFilter::try_new(r).ok())
        .unwrap_or_else(|| EnvFilter::new(default_filter));
    let guard = payload_guard(rust_log);
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(writer);
    match format {
        LogFormat::Text => Box::new(builder.finish().with(guard)),
        LogFormat::Json => Box::new(builder.json().flatten_event(true).finish().with(guard)),
    }
}

/// Caps each of lapin's body-printing targets at its level, except a target one of
/// `rust_log`'s directives names (`lapin::returned_messages=warn`); everything else passes
/// (the `EnvFilter` decides). A filter that only lowers levels: it never turns on what
/// `RUST_LOG` left off.
fn payload_guard(rust_log: Option<&str>) -> Targets {
    let named = |target: &str| {
        rust_log.is_some_and(|r| {
            r.split(',').any(|directive| {
                let name = directive.split(['[', '=']).next().unwrap_or("").trim();
                name == target || name.starts_with(&format!("{target}::"))
            })
        })
    };
    let mut guard = Targets::new().with_default(LevelFilter::TRACE);
    for (target, cap) in PAYLOAD_LOG_TARGETS {
        if !named(target) {
            guard = guard.with_target(target, cap);
        }
    }
    guard
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tracing::Level;

    use super::*;

    // The kit's list names the targets (this file may not name lapin's API itself).
    const RETURNED: &str = PAYLOAD_LOG_TARGETS[0].0;
    const CHANNELS: &str = PAYLOAD_LOG_TARGETS[1].0;
    const FRAMES: &str = PAYLOAD_LOG_TARGETS[2].0;

    #[test]
    fn body_printing_targets_are_capped_unless_named() {
        for rust_log in [None, Some("info"), Some("trace"), Some("lapin=trace,info")] {
            let guard = payload_guard(rust_log);
            assert!(!guard.would_enable(RETURNED, &Level::WARN), "{rust_log:?}");
            assert!(!guard.would_enable(CHANNELS, &Level::TRACE));
            assert!(!guard.would_enable(FRAMES, &Level::TRACE));
            assert!(guard.would_enable(CHANNELS, &Level::ERROR));
            assert!(guard.would_enable("lapin", &Level::TRACE));
            assert!(guard.would_enable("outbox_relay", &Level::TRACE));
        }
        let guard = payload_guard(Some(&format!("info,{RETURNED}=warn")));
        assert!(guard.would_enable(RETURNED, &Level::WARN));
        assert!(!guard.would_enable(CHANNELS, &Level::TRACE));
        let guard = payload_guard(Some(&format!("{CHANNELS}[io]=trace")));
        assert!(guard.would_enable(CHANNELS, &Level::TRACE));
    }

    /// A captured log: what the subscriber wrote.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn logged(format: LogFormat, rust_log: Option<&str>) -> String {
        let out = Captured::default();
        let writer = out.clone();
        let sub = subscriber(format, "info,lapin=error", rust_log, false, move || {
            writer.clone()
        });
        tracing::subscriber::with_default(sub, || {
            tracing::warn!(target: RETURNED, returned = "card 4111", "Server returned us a message");
            tracing::warn!(target: "outbox_relay", "row returned");
        });
        String::from_utf8(out.0.lock().unwrap().clone()).unwrap()
    }

    /// The whole subscriber, as `RUST_LOG=info` sets it up: lapin's returned-message line
    /// (with the body) is dropped, the relay's own line is kept; naming the target brings
    /// it back.
    #[test]
    fn rust_log_info_keeps_returned_bodies_out_of_the_log() {
        for format in [LogFormat::Text, LogFormat::Json] {
            let log = logged(format, Some("info"));
            assert!(log.contains("row returned"), "{log}");
            assert!(!log.contains("4111"), "{log}");
        }
        let log = logged(LogFormat::Text, Some(&format!("info,{RETURNED}=warn")));
        assert!(log.contains("4111"), "named, the target logs: {log}");
    }
}
