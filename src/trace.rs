//! Stage timestamps for the benchmark's per-event latency breakdown (`run --stage-trace
//! FILE`, a hidden flag): one text line per stage of one claim or batch, `<stage> <unix ns>
//! <row id>...`, where stage is `N` (a NOTIFY reached the engine), `S` (a claim was sent),
//! `R` (that claim returned, with the ids it brought), `P` (rows handed to the lanes), `A`
//! (acks the engine took in), `U` (a mark was sent) or `M` (that mark committed, with its
//! ids). Claims run one at a time and so do marks, so each `R` closes the `S` before it and
//! each `M` the `U` before it. `outbox-bench` reads the file and joins it with its own
//! commit and arrival times (docs/benchmarks.md, "Steady latency").
//!
//! Off by default, and then the engine pays one `Option` check per claim, batch and mark.
//! On, the lines go to a buffered file (written out when the buffer fills, and at the end
//! of the run): wall-clock time, because the bench is another process.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

/// One step of an event's way through the relay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// A NOTIFY reached the engine.
    Notified,
    /// A claim was sent to Postgres.
    ClaimSent,
    /// The claim returned these rows.
    ClaimReturned,
    /// These rows were handed to the lanes to publish.
    Published,
    /// The broker's acks of these rows reached the engine.
    Acked,
    /// A mark was sent (its rows are on the `M` line that closes it).
    MarkSent,
    /// The mark of these rows committed.
    Marked,
}

impl Stage {
    fn letter(self) -> char {
        match self {
            Stage::Notified => 'N',
            Stage::ClaimSent => 'S',
            Stage::ClaimReturned => 'R',
            Stage::Published => 'P',
            Stage::Acked => 'A',
            Stage::MarkSent => 'U',
            Stage::Marked => 'M',
        }
    }
}

/// Where the stage lines go; cheap to clone (one shared file).
#[derive(Clone, Debug)]
pub struct StageTrace {
    out: Arc<Mutex<BufWriter<File>>>,
}

impl StageTrace {
    /// Creates (or truncates) `path`.
    pub fn create(path: &Path) -> std::io::Result<StageTrace> {
        let file = File::create(path)?;
        Ok(StageTrace {
            out: Arc::new(Mutex::new(BufWriter::with_capacity(1 << 20, file))),
        })
    }

    /// Writes one line: `stage` happened now to the rows `ids` (none for a NOTIFY or a
    /// claim sent). Write errors are ignored: the trace is a diagnostic.
    pub fn record(&self, stage: Stage, ids: impl IntoIterator<Item = i64>) {
        use std::fmt::Write as _;
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let mut line = format!("{} {now}", stage.letter());
        for id in ids {
            let _ = write!(line, " {id}");
        }
        line.push('\n');
        if let Ok(mut out) = self.out.lock() {
            let _ = out.write_all(line.as_bytes());
        }
    }

    /// Writes out what is buffered (at the end of the run).
    pub fn flush(&self) {
        if let Ok(mut out) = self.out.lock() {
            let _ = out.flush();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_carry_the_stage_the_time_and_the_ids() {
        let dir = std::env::temp_dir().join(format!("stage_trace_{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("trace");
        let t = StageTrace::create(&path).unwrap();
        t.record(Stage::ClaimSent, []);
        t.record(Stage::ClaimReturned, [7, 9]);
        t.clone().record(Stage::Marked, [9]);
        t.flush();
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<Vec<&str>> = text.lines().map(|l| l.split(' ').collect()).collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert_eq!(lines[0][0], "S");
        assert_eq!(lines[0].len(), 2);
        assert_eq!(&lines[1][0], &"R");
        assert_eq!(&lines[1][2..], &["7", "9"]);
        assert_eq!(&lines[2][2..], &["9"]);
        let t0: u128 = lines[0][1].parse().unwrap();
        let t2: u128 = lines[2][1].parse().unwrap();
        assert!(t0 > 1_600_000_000_000_000_000 && t2 >= t0, "{text}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
