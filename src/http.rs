//! The operator's HTTP endpoint (`--http-listen`): `/livez`, `/readyz`, `/metrics`, the
//! dashboard at `/`, and the JSON API the dashboard uses.
//!
//! Invariants: `/readyz` is 200 only while Postgres answers, an AMQP session is open and
//! the relay is not shutting down. Re-driving (`POST /api/redrive`) needs the admin token
//! as `Authorization: Bearer <token>`; without a configured token the endpoint refuses
//! every write (the dashboard is read-only). A sampler looks at the table every
//! [`SAMPLE_EVERY`] (pending, oldest pending, parked) for the gauges and the chart.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use deadpool_postgres::Pool;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::operator::{self, ParkedFilter};
use outbox_kit::contract::Secret;
use outbox_kit::db::{DbError, deadline};
use outbox_kit::down::Down;

use crate::telemetry::Telemetry;

/// How often the sampler looks at the table.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(2);
/// How many samples the chart keeps (10 minutes).
const HISTORY: usize = 300;

const DASHBOARD: &str = include_str!("dashboard.html");
/// The dashboard runs only its own inline script and talks only to this endpoint (so a
/// typed admin token cannot be sent elsewhere), and may not be framed by another site.
const DASHBOARD_CSP: &str = "default-src 'none'; script-src 'unsafe-inline'; \
    style-src 'unsafe-inline'; connect-src 'self'; img-src 'self'; base-uri 'none'; \
    form-action 'none'; frame-ancestors 'none'";

/// One look at the outbox, for the chart.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    pub unix: f64,
    pub pending: i64,
    pub oldest_pending_seconds: f64,
    pub parked: i64,
    pub dispatched_total: u64,
}

#[derive(Clone)]
pub struct HttpState {
    pub telemetry: Telemetry,
    pub pool: Pool,
    pub admin_token: Option<Secret>,
    history: Arc<Mutex<VecDeque<Sample>>>,
}

impl HttpState {
    pub fn new(telemetry: Telemetry, pool: Pool, admin_token: Option<Secret>) -> HttpState {
        HttpState {
            telemetry,
            pool,
            admin_token,
            history: Arc::new(Mutex::new(VecDeque::with_capacity(HISTORY))),
        }
    }
}

/// Serves until `shutdown`; the sampler runs alongside.
pub async fn serve(
    listener: TcpListener,
    state: HttpState,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    tokio::spawn(sample(state.clone(), shutdown.clone()));
    let app = Router::new()
        .route("/", get(dashboard))
        .route("/livez", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/api/overview", get(overview))
        .route("/api/parked", get(parked))
        .route("/api/redrive", post(redrive))
        .with_state(state);
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
}

/// Pending rows and the lag: how long the oldest due row has been due (since `available_at`,
/// or `created_at` when that is later), so rows delayed into the future do not look like a
/// stuck relay. One pass over the pending index for both figures.
const COUNTS: &str = "SELECT p.pending, p.oldest_due,
    (SELECT count(*) FROM outbox_events WHERE parked_at IS NOT NULL),
    extract(epoch FROM now())::float8
  FROM (SELECT count(*) AS pending,
               coalesce(extract(epoch FROM now() - min(greatest(created_at, available_at))
                          FILTER (WHERE available_at <= now()))::float8, 0) AS oldest_due
          FROM outbox_events WHERE dispatched_at IS NULL AND parked_at IS NULL) p";

async fn sample_once(state: &HttpState) -> Result<Sample, DbError> {
    let client = deadline(state.pool.get()).await?;
    let row = deadline(client.query_one(COUNTS, &[])).await?;
    Ok(Sample {
        pending: row.get(0),
        oldest_pending_seconds: row.get(1),
        parked: row.get(2),
        unix: row.get(3),
        dispatched_total: state.telemetry.metrics.dispatched.get(),
    })
}

async fn sample(state: HttpState, shutdown: CancellationToken) {
    let mut down = Down::new("dashboard sampler");
    loop {
        match sample_once(&state).await {
            Ok(s) => {
                down.recovered();
                state
                    .telemetry
                    .outbox_sampled(s.pending, s.oldest_pending_seconds, s.parked);
                let mut h = state.history.lock().expect("history lock");
                if h.len() == HISTORY {
                    h.pop_front();
                }
                h.push_back(s);
            }
            Err(e) => down.failed(&e, SAMPLE_EVERY),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(SAMPLE_EVERY) => {}
        }
    }
}

async fn dashboard() -> Response {
    (
        [(header::CONTENT_SECURITY_POLICY, DASHBOARD_CSP)],
        Html(DASHBOARD),
    )
        .into_response()
}

async fn readyz(State(state): State<HttpState>) -> Response {
    let health = &state.telemetry.health;
    if health.ready() {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {}\n", health.describe()),
        )
            .into_response()
    }
}

async fn metrics(State(state): State<HttpState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.telemetry.metrics.encode(),
    )
        .into_response()
}

fn db_error(e: DbError) -> Response {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        Json(json!({ "error": e.to_string() })),
    )
        .into_response()
}

async fn overview(State(state): State<HttpState>) -> Response {
    let client = match deadline(state.pool.get()).await {
        Ok(c) => c,
        Err(e) => return db_error(e),
    };
    let mut status = match operator::status(&client).await {
        Ok(s) => s,
        Err(e) => return db_error(e),
    };
    let history: Vec<Value> = state
        .history
        .lock()
        .expect("history lock")
        .iter()
        .map(|s| {
            json!({
                "t": s.unix, "pending": s.pending, "oldest_pending_seconds": s.oldest_pending_seconds,
                "parked": s.parked, "dispatched_total": s.dispatched_total,
            })
        })
        .collect();
    status["history"] = Value::Array(history);
    status["ready"] = Value::Bool(state.telemetry.health.ready());
    status["health"] = Value::String(state.telemetry.health.describe());
    status["read_only"] = Value::Bool(state.admin_token.is_none());
    status["sample_every_seconds"] = json!(SAMPLE_EVERY.as_secs_f64());
    Json(status).into_response()
}

#[derive(Debug, serde::Deserialize)]
struct ParkedQuery {
    event_type: Option<String>,
    aggregate_type: Option<String>,
    aggregate_id: Option<String>,
    limit: Option<i64>,
}

fn non_empty(s: Option<String>) -> Option<String> {
    s.filter(|s| !s.trim().is_empty())
}

async fn parked(State(state): State<HttpState>, Query(q): Query<ParkedQuery>) -> Response {
    let filter = ParkedFilter {
        event_type: non_empty(q.event_type),
        aggregate_type: non_empty(q.aggregate_type),
        aggregate_id: non_empty(q.aggregate_id),
        ..ParkedFilter::default()
    };
    let client = match deadline(state.pool.get()).await {
        Ok(c) => c,
        Err(e) => return db_error(e),
    };
    match operator::parked(&client, &filter, q.limit.unwrap_or(200).clamp(1, 1000)).await {
        Ok(rows) => Json(operator::parked_json(&rows)).into_response(),
        Err(e) => db_error(e),
    }
}

#[derive(Debug, serde::Deserialize)]
struct RedriveBody {
    ids: Vec<i64>,
}

/// Equal tokens, in time that does not depend on where they differ.
fn same_token(given: &str, expected: &str) -> bool {
    given.len() == expected.len()
        && given
            .bytes()
            .zip(expected.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

async fn redrive(
    State(state): State<HttpState>,
    headers: HeaderMap,
    Json(body): Json<RedriveBody>,
) -> Response {
    let Some(expected) = &state.admin_token else {
        return (
            StatusCode::FORBIDDEN,
            Json(json!({ "error": "read-only: start the relay with --admin-token to allow re-driving" })),
        )
            .into_response();
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if !same_token(given, expected.expose()) {
        return (
            StatusCode::UNAUTHORIZED,
            Json(json!({ "error": "wrong or missing admin token" })),
        )
            .into_response();
    }
    if body.ids.is_empty() {
        return (
            StatusCode::BAD_REQUEST,
            Json(json!({ "error": "ids must name at least one parked row" })),
        )
            .into_response();
    }
    let filter = ParkedFilter {
        ids: body.ids,
        ..ParkedFilter::default()
    };
    let mut client = match deadline(state.pool.get()).await {
        Ok(c) => c,
        Err(e) => return db_error(e),
    };
    match operator::redrive(&mut client, &filter, false).await {
        Ok(done) => {
            tracing::info!(target: "outbox_relay", rows = done.rows, keys = done.keys, "re-driven from the dashboard");
            Json(json!({ "redriven": done.rows, "summary": done.summary() })).into_response()
        }
        Err(e) => db_error(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn dashboard_is_self_contained_and_not_frameable() {
        let r = dashboard().await;
        let csp = r.headers()[header::CONTENT_SECURITY_POLICY]
            .to_str()
            .unwrap();
        assert!(csp.contains("connect-src 'self'") && csp.contains("frame-ancestors 'none'"));
        assert!(
            r.headers()[header::CONTENT_TYPE]
                .to_str()
                .unwrap()
                .starts_with("text/html")
        );
        for external in ["http://", "https://", "//cdn", "@import"] {
            assert!(
                !DASHBOARD.contains(external),
                "the page loads nothing: {external}"
            );
        }
    }

    #[test]
    fn tokens_compare_whole() {
        assert!(same_token("s3cret", "s3cret"));
        assert!(!same_token("s3cret", "s3cres"));
        assert!(!same_token("s3cre", "s3cret"));
        assert!(!same_token("", "s3cret"));
    }
}
