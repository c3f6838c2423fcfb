//! Schema migrations: the numbered files in `sql/`, applied in order under an advisory
//! lock, each recorded with a checksum; then the files of current function bodies in
//! `sql/functions/` ([`REPEATABLE`]), each applied again whenever its revision is newer
//! than the one recorded.
//!
//! Invariants: a migration is applied at most once per schema (the lock serializes
//! concurrent relays starting together); an applied migration whose file changed is
//! refused with [`MigrateError::Changed`], never re-run or skipped silently. A function
//! file is applied when the schema holds an older revision of it (or none), never over a
//! newer one (an older binary leaves a newer relay's bodies alone), and a file changed
//! under the revision already applied is refused with [`MigrateError::RevisionChanged`].
//! The files are plain SQL written for `search_path = <schema>`, so other tools can apply
//! them too (the numbered ones in order, then the function files).
//!
//! `kit/sql` is a symbolic link to the repository's `sql/`: the files are included through
//! it (`../sql/...`), so the published `outbox-kit` package carries them (cargo follows the
//! link) while the repository keeps one copy, where every language's users find it.

use tokio_postgres::Client;

use crate::contract::Schema;
use crate::db::{DbError, deadline};

/// One numbered migration file.
pub struct Migration {
    /// Its number; applied in ascending order.
    pub version: i32,
    /// Its file name in `sql/`.
    pub name: &'static str,
    /// The file's text.
    pub sql: &'static str,
}

/// Every migration, in order. Add new files at the end; never edit an applied one. Include
/// them as `../sql/<file>` (inside the package; tests/it/contract.rs checks it).
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "0001_outbox.sql",
        sql: include_str!("../sql/0001_outbox.sql"),
    },
    Migration {
        version: 2,
        name: "0002_relay.sql",
        sql: include_str!("../sql/0002_relay.sql"),
    },
    Migration {
        version: 3,
        name: "0003_consumer.sql",
        sql: include_str!("../sql/0003_consumer.sql"),
    },
    Migration {
        version: 4,
        name: "0004_event_ids.sql",
        sql: include_str!("../sql/0004_event_ids.sql"),
    },
    Migration {
        version: 5,
        name: "0005_claim_plans.sql",
        sql: include_str!("../sql/0005_claim_plans.sql"),
    },
    Migration {
        version: 6,
        name: "0006_claim_held.sql",
        sql: include_str!("../sql/0006_claim_held.sql"),
    },
    Migration {
        version: 7,
        name: "0007_claim_numbers.sql",
        sql: include_str!("../sql/0007_claim_numbers.sql"),
    },
    Migration {
        version: 8,
        name: "0008_wakeup_hint.sql",
        sql: include_str!("../sql/0008_wakeup_hint.sql"),
    },
    Migration {
        version: 9,
        name: "0009_fenced_failures.sql",
        sql: include_str!("../sql/0009_fenced_failures.sql"),
    },
    Migration {
        version: 10,
        name: "0010_effects_ledger.sql",
        sql: include_str!("../sql/0010_effects_ledger.sql"),
    },
    Migration {
        version: 11,
        name: "0011_bounded_claims.sql",
        sql: include_str!("../sql/0011_bounded_claims.sql"),
    },
    Migration {
        version: 12,
        name: "0012_consumer_groups.sql",
        sql: include_str!("../sql/0012_consumer_groups.sql"),
    },
    Migration {
        version: 13,
        name: "0013_claim_plan_cache.sql",
        sql: include_str!("../sql/0013_claim_plan_cache.sql"),
    },
    Migration {
        version: 14,
        name: "0014_late_events.sql",
        sql: include_str!("../sql/0014_late_events.sql"),
    },
    Migration {
        version: 15,
        name: "0015_numbered_at_insert.sql",
        sql: include_str!("../sql/0015_numbered_at_insert.sql"),
    },
    Migration {
        version: 16,
        name: "0016_effect_order.sql",
        sql: include_str!("../sql/0016_effect_order.sql"),
    },
    Migration {
        version: 17,
        name: "0017_contract.sql",
        sql: include_str!("../sql/0017_contract.sql"),
    },
    Migration {
        version: 18,
        name: "0018_replay.sql",
        sql: include_str!("../sql/0018_replay.sql"),
    },
    Migration {
        version: 19,
        name: "0019_parked_events.sql",
        sql: include_str!("../sql/0019_parked_events.sql"),
    },
    Migration {
        version: 20,
        name: "0020_consumer_attempts.sql",
        sql: include_str!("../sql/0020_consumer_attempts.sql"),
    },
];

/// A file of current function bodies (`CREATE OR REPLACE` only), applied after the
/// numbered migrations whenever the schema holds an older revision of it.
pub struct Repeatable {
    /// Its path under `sql/`.
    pub name: &'static str,
    /// Raised with every change to the file.
    pub revision: i32,
    /// The file's text.
    pub sql: &'static str,
}

/// Every function file. Raise a file's revision with every change to it (the migrate
/// test of function files checks that the file applied under a revision stays the same).
pub const REPEATABLE: &[Repeatable] = &[Repeatable {
    name: "functions/claim.sql",
    revision: 1,
    sql: include_str!("../sql/functions/claim.sql"),
}];

/// Why the migrations were not applied.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MigrateError {
    /// The database could not be reached or refused a statement.
    #[error(transparent)]
    Db(#[from] DbError),
    /// A migration already applied no longer matches its file.
    #[error(
        "migration {name} was applied with checksum {applied} but the file now has {current}; \
         applied migrations must not change: restore the file and put the change in a new migration"
    )]
    Changed {
        /// The migration file.
        name: String,
        /// The checksum recorded when it was applied.
        applied: String,
        /// The checksum of the file now.
        current: String,
    },
    /// A function file was applied under this revision with other contents.
    #[error(
        "{name} revision {revision} was applied with checksum {applied} but the file now has \
         {current}; raise its revision in kit/src/schema.rs (REPEATABLE) with every change"
    )]
    RevisionChanged {
        /// The function file.
        name: String,
        /// The revision both carry.
        revision: i32,
        /// The checksum recorded when it was applied.
        applied: String,
        /// The checksum of the file now.
        current: String,
    },
    /// The database has migrations this binary does not know (a newer relay migrated it).
    #[error(
        "schema has migration {version} that this outbox-relay does not know: upgrade outbox-relay"
    )]
    Unknown {
        /// The unknown migration's number.
        version: i32,
    },
}

impl From<tokio_postgres::Error> for MigrateError {
    fn from(e: tokio_postgres::Error) -> Self {
        MigrateError::Db(e.into())
    }
}

const CREATE_SCHEMA: &str = "CREATE SCHEMA IF NOT EXISTS";
const LOCK: &str =
    "SELECT pg_advisory_xact_lock(hashtextextended('outbox-relay:migrate:' || $1::text, 0))";
const CREATE_LEDGER: &str = "CREATE TABLE IF NOT EXISTS outbox_schema_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    checksum   text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now())";
const APPLIED: &str =
    "SELECT version, name, checksum FROM outbox_schema_migrations ORDER BY version";
const CHECKSUM: &str = "SELECT encode(sha256(convert_to($1::text, 'UTF8')), 'hex')";
const RECORD: &str =
    "INSERT INTO outbox_schema_migrations (version, name, checksum) VALUES ($1, $2, $3)";
const CREATE_FUNCTION_LEDGER: &str = "CREATE TABLE IF NOT EXISTS outbox_schema_functions (
    name       text PRIMARY KEY,
    revision   integer NOT NULL,
    checksum   text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now())";
const FUNCTIONS_APPLIED: &str =
    "SELECT revision, checksum FROM outbox_schema_functions WHERE name = $1";
const RECORD_FUNCTIONS: &str = "INSERT INTO outbox_schema_functions (name, revision, checksum)
    VALUES ($1, $2, $3)
    ON CONFLICT (name) DO UPDATE
    SET revision = excluded.revision, checksum = excluded.checksum, applied_at = now()";

/// What `migrate` did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct MigrateReport {
    /// The migrations applied now, by file name.
    pub applied: Vec<String>,
    /// How many had been applied before.
    pub already: usize,
    /// The function files applied now, as `name (revision N)`.
    pub functions: Vec<String>,
}

impl MigrateReport {
    /// Everything applied now: the migrations, then the function files.
    pub fn changed(&self) -> Vec<String> {
        [&self.applied[..], &self.functions[..]].concat()
    }
}

/// Applies the pending migrations to `schema` in one transaction.
pub async fn migrate(client: &mut Client, schema: &Schema) -> Result<MigrateReport, MigrateError> {
    let tx = deadline(client.transaction()).await?;
    // Lock first: two relays starting together must not race to create the schema.
    deadline(tx.execute(LOCK, &[&schema.as_str()])).await?;
    deadline(tx.batch_execute(&format!("{CREATE_SCHEMA} {schema}"))).await?;
    deadline(tx.batch_execute(&format!("SET LOCAL search_path TO {schema}"))).await?;
    deadline(tx.batch_execute(CREATE_LEDGER)).await?;

    let applied = deadline(tx.query(APPLIED, &[])).await?;
    let mut report = MigrateReport::default();
    for row in &applied {
        let version: i32 = row.get(0);
        let name: String = row.get(1);
        let checksum: String = row.get(2);
        let Some(m) = MIGRATIONS.iter().find(|m| m.version == version) else {
            return Err(MigrateError::Unknown { version });
        };
        let current: String = deadline(tx.query_one(CHECKSUM, &[&m.sql])).await?.get(0);
        if current != checksum {
            return Err(MigrateError::Changed {
                name,
                applied: checksum,
                current,
            });
        }
        report.already += 1;
    }
    for m in MIGRATIONS {
        if applied.iter().any(|r| r.get::<_, i32>(0) == m.version) {
            continue;
        }
        deadline(tx.batch_execute(m.sql)).await?;
        let checksum: String = deadline(tx.query_one(CHECKSUM, &[&m.sql])).await?.get(0);
        deadline(tx.execute(RECORD, &[&m.version, &m.name, &checksum])).await?;
        report.applied.push(m.name.to_owned());
    }
    deadline(tx.batch_execute(CREATE_FUNCTION_LEDGER)).await?;
    for f in REPEATABLE {
        let current: String = deadline(tx.query_one(CHECKSUM, &[&f.sql])).await?.get(0);
        if let Some(row) = deadline(tx.query_opt(FUNCTIONS_APPLIED, &[&f.name])).await? {
            let (revision, applied): (i32, String) = (row.get(0), row.get(1));
            if revision > f.revision || revision == f.revision && applied == current {
                continue;
            }
            if revision == f.revision {
                return Err(MigrateError::RevisionChanged {
                    name: f.name.to_owned(),
                    revision,
                    applied,
                    current,
                });
            }
        }
        deadline(tx.batch_execute(f.sql)).await?;
        deadline(tx.execute(RECORD_FUNCTIONS, &[&f.name, &f.revision, &current])).await?;
        report
            .functions
            .push(format!("{} (revision {})", f.name, f.revision));
    }
    deadline(tx.commit()).await?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::MIGRATIONS;

    /// Migrations run in the order of this list: a file registered out of place (as
    /// happened when branches adding 0015-0019 were merged) would run before one it needs.
    #[test]
    fn migrations_are_listed_in_version_order_under_their_own_number() {
        for (i, m) in MIGRATIONS.iter().enumerate() {
            assert_eq!(
                m.version,
                i as i32 + 1,
                "{} is listed at place {}",
                m.name,
                i + 1
            );
            assert!(
                m.name.starts_with(&format!("{:04}_", m.version)),
                "{} is registered as version {}",
                m.name,
                m.version
            );
        }
    }
}
