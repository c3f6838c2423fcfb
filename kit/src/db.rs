//! Postgres connections: the parsed target, the pool the relay claims and marks through,
//! and the dedicated connection that LISTENs.
//!
//! Architecture invariant: LISTEN never runs on a pooled connection (a pooled connection's
//! notifications are dropped by the pool's driver); [`DbTarget::connect_dedicated`] is the
//! only way to get one, and only `relay/listen.rs` calls it for that.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime, Timeouts};
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres::{Client, Connection, Socket};
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::contract::Schema;
use crate::tls::{PgTls, split_tls_params};

/// A dedicated connection (TLS or not, as `sslmode` says); the caller drives it.
pub type PgConnection = Connection<Socket, <MakeRustlsConnect as MakeTlsConnect<Socket>>::Stream>;

/// How long any single database round trip may take before we give up on it.
const DB_TIMEOUT: Duration = Duration::from_secs(30);
/// The server stops a statement this long after it started: before [`DB_TIMEOUT`], so a
/// statement whose client gave up never runs on and commits behind its back (the client
/// would retry a write that did happen). A connection string that sets its own
/// statement_timeout in `options` keeps it.
const STATEMENT_TIMEOUT: Duration = Duration::from_secs(25);

/// Where the database is. Debug output never shows the password.
#[derive(Clone)]
pub struct DbTarget {
    config: tokio_postgres::Config,
    tls: PgTls,
}

impl fmt::Debug for DbTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DbTarget")
            .field("hosts", &self.config.get_hosts())
            .field("ports", &self.config.get_ports())
            .field("user", &self.config.get_user())
            .field("dbname", &self.config.get_dbname())
            .field("tls", &self.tls)
            .finish_non_exhaustive()
    }
}

/// A database error at a module boundary.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DbError {
    /// The server or the network failed, or the server refused a statement.
    #[error("postgres: {}", with_sources(.0))]
    Postgres(#[from] tokio_postgres::Error),
    /// No connection could be taken from the pool.
    #[error("postgres pool: {}", with_sources(.0))]
    Pool(#[from] deadpool_postgres::PoolError),
    /// The round trip took longer than its deadline.
    #[error("postgres: no answer within {0:?}")]
    Timeout(Duration),
    /// The server closed the connection.
    #[error("postgres: connection closed")]
    Closed,
}

/// An error and its causes on one line ("error connecting to server: Connection refused").
pub(crate) fn with_sources(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let more = s.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = s.source();
    }
    text
}

impl DbError {
    /// Whether no connection could be had: the pool could not open one (the server is at
    /// its connection limit, restarting, or out of reach) or none came free. Nothing of the
    /// caller's work reached the server, so it says nothing about that work.
    pub fn is_no_connection(&self) -> bool {
        matches!(self, DbError::Pool(_))
    }

    /// Whether waiting and retrying can help (connection trouble), as opposed to a
    /// statement the server will refuse again (permissions, missing schema, bad SQL).
    pub fn is_transient(&self) -> bool {
        match self {
            DbError::Timeout(_) | DbError::Closed => true,
            // A certificate the roots do not vouch for stays so: stop and say so.
            DbError::Pool(e) => !crate::tls::is_certificate_error(e),
            DbError::Postgres(e) => match e.code() {
                None => !crate::tls::is_certificate_error(e),
                Some(code) => {
                    let c = code.code();
                    // 08: connection exception, 53: insufficient resources, 57: operator
                    // intervention (terminated, shutting down), 40: serialization/deadlock.
                    c.starts_with("08")
                        || c.starts_with("53")
                        || c.starts_with("57")
                        || c.starts_with("40")
                }
            },
        }
    }
}

pub(crate) use plumbing::deadline;

/// Shared with the relay through [`crate::internal`]; not part of the kit's API.
pub(crate) mod plumbing {
    use super::{DB_TIMEOUT, DbError};

    /// Runs `fut` with the standard database deadline.
    pub async fn deadline<T, E: Into<DbError>>(
        fut: impl Future<Output = Result<T, E>>,
    ) -> Result<T, DbError> {
        match tokio::time::timeout(DB_TIMEOUT, fut).await {
            Ok(r) => r.map_err(Into::into),
            Err(_) => Err(DbError::Timeout(DB_TIMEOUT)),
        }
    }
}

impl DbTarget {
    /// Parses a URL (`postgres://...`) or key=value connection string.
    pub fn parse(raw: &str) -> Result<DbTarget, String> {
        let (rest, tls) = split_tls_params(raw)?;
        let config = tokio_postgres::Config::from_str(&rest)
            .map_err(|e| format!("not a valid Postgres connection string ({e})"))?;
        if config.get_hosts().is_empty() {
            return Err("names no host; write it like postgres://user@host:5432/db".into());
        }
        Ok(DbTarget { config, tls })
    }

    /// The database name, or the user name when none is given (libpq's rule).
    pub fn dbname(&self) -> Option<&str> {
        self.config.get_dbname().or(self.config.get_user())
    }

    /// The same server with another database name (tests create one per test).
    pub fn with_dbname(&self, dbname: &str) -> DbTarget {
        let mut config = self.config.clone();
        config.dbname(dbname);
        DbTarget {
            config,
            tls: self.tls.clone(),
        }
    }

    /// The tokio-postgres configuration with our session settings: search_path set to the
    /// outbox schema, a statement_timeout under the client's deadline, an application_name
    /// operators can find, and connect/keepalive limits.
    fn session_config(&self, schema: &Schema, application_name: &str) -> tokio_postgres::Config {
        self.session_config_with(schema, application_name, STATEMENT_TIMEOUT)
    }

    /// [`DbTarget::session_config`] with another statement_timeout.
    fn session_config_with(
        &self,
        schema: &Schema,
        application_name: &str,
        statement_timeout: Duration,
    ) -> tokio_postgres::Config {
        let mut config = self.config.clone();
        if config.get_application_name().is_none() {
            config.application_name(application_name);
        }
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(Duration::from_secs(10));
        }
        config.keepalives(true);
        config.keepalives_idle(Duration::from_secs(30));
        let mut ours = format!("-c search_path={schema}");
        let existing = config.get_options().unwrap_or_default();
        if !existing.contains("statement_timeout") {
            ours = format!(
                "{ours} -c statement_timeout={}",
                statement_timeout.as_millis()
            );
        }
        let options = if existing.is_empty() {
            ours
        } else {
            format!("{existing} {ours}")
        };
        config.options(&options);
        config
    }

    /// A pool of connections with `search_path` set to `schema`.
    pub fn pool(&self, schema: &Schema, application_name: &str, size: usize) -> Pool {
        self.pool_with_statement_timeout(schema, application_name, size, STATEMENT_TIMEOUT)
    }

    /// [`DbTarget::pool`] whose sessions stop a statement after `statement_timeout` (at
    /// most the 25 s every other session has; a connection string's own setting wins).
    /// The relay's HTTP endpoint reads through such a pool of its own.
    pub fn pool_with_statement_timeout(
        &self,
        schema: &Schema,
        application_name: &str,
        size: usize,
        statement_timeout: Duration,
    ) -> Pool {
        let manager = Manager::from_config(
            self.session_config_with(
                schema,
                application_name,
                statement_timeout.min(STATEMENT_TIMEOUT),
            ),
            self.tls.connector(),
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        Pool::builder(manager)
            .max_size(size)
            .runtime(Runtime::Tokio1)
            .timeouts(Timeouts {
                wait: Some(DB_TIMEOUT),
                create: Some(Duration::from_secs(15)),
                recycle: Some(Duration::from_secs(5)),
            })
            .build()
            .expect("pool builder with a runtime and timeouts never fails")
    }

    /// One connection of its own (not pooled), for LISTEN and for one-off commands.
    /// The caller drives the returned `Connection`.
    pub async fn connect_dedicated(
        &self,
        schema: &Schema,
        application_name: &str,
    ) -> Result<(Client, PgConnection), DbError> {
        deadline(
            self.session_config(schema, application_name)
                .connect(self.tls.connector()),
        )
        .await
    }

    /// A dedicated connection driven in the background; for commands and tests.
    pub async fn connect(
        &self,
        schema: &Schema,
        application_name: &str,
    ) -> Result<Client, DbError> {
        let (client, connection) = self.connect_dedicated(schema, application_name).await?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "postgres connection ended");
            }
        });
        Ok(client)
    }
}
