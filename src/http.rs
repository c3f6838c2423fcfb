//! The operator's HTTP endpoint (`--http-listen`): `/livez`, `/readyz`, `/metrics`, the
//! dashboard at `/`, and the JSON API the dashboard uses.
//!
//! Invariants: `/readyz` is 200 only while Postgres answers, an AMQP session is open and
//! the relay is not shutting down. With an admin token configured, every `/api/*` request
//! needs it as `Authorization: Bearer <token>`; without one the read-only views stay open
//! and re-driving (`POST /api/redrive`) is refused (the dashboard is read-only).
//!
//! Architecture invariant: nothing a client does here can starve the relay. The endpoint
//! reads through a pool of its own ([`Limits::connections`], a short statement_timeout),
//! never the relay's, so lease renewals and marks never wait behind a page; at most
//! [`Limits::concurrent_api`] API requests run at once (more get 503 at once, no queue);
//! a client gets [`Limits::header_read`] to send its headers and [`Limits::request`] for
//! the rest, and at most [`Limits::clients`] connections are open; and no request counts the whole backlog: a sampler counts (bounded) every
//! [`SAMPLE_EVERY`] for the gauges and the chart, and the overview reads its last sample.
//! Database errors are logged; only a caller holding the admin token sees their text.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use deadpool_postgres::Pool;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::operator::{self, Counts, ParkedFilter};
use outbox_kit::contract::{Schema, Secret};
use outbox_kit::db::{DbError, DbTarget};
use outbox_kit::internal::Down;
use outbox_kit::internal::deadline;

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

/// What the endpoint allows a client (docs/operating.md, "Dashboard").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Connections of the endpoint's own pool (API requests and the sampler).
    pub connections: usize,
    /// Client connections open at once; one more is closed at once (file descriptors are
    /// the relay's too: it needs them to reconnect to Postgres and RabbitMQ).
    pub clients: usize,
    /// API requests running at once; one more gets 503 without waiting.
    pub concurrent_api: usize,
    /// Time a client has to send a request's headers (also how long an idle keep-alive
    /// connection stays open); then the connection is closed.
    pub header_read: Duration,
    /// Time from the headers to the response (reading the body included); then 503.
    pub request: Duration,
    /// The server stops any statement of the endpoint after this long.
    pub statement: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            connections: 3,
            clients: 128,
            concurrent_api: 4,
            header_read: Duration::from_secs(10),
            request: Duration::from_secs(10),
            statement: Duration::from_secs(5),
        }
    }
}

/// One look at the outbox, for the chart.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    pub counts: Counts,
    pub dispatched_total: u64,
}

#[derive(Clone)]
pub struct HttpState {
    pub telemetry: Telemetry,
    pool: Pool,
    pub admin_token: Option<Secret>,
    limits: Limits,
    api_slots: Arc<Semaphore>,
    history: Arc<Mutex<VecDeque<Sample>>>,
}

impl HttpState {
    /// The endpoint's state with the default [`Limits`]; it connects to `db` through a pool
    /// of its own.
    pub fn new(
        telemetry: Telemetry,
        db: &DbTarget,
        schema: &Schema,
        admin_token: Option<Secret>,
    ) -> HttpState {
        HttpState::with_limits(telemetry, db, schema, admin_token, Limits::default())
    }

    pub fn with_limits(
        telemetry: Telemetry,
        db: &DbTarget,
        schema: &Schema,
        admin_token: Option<Secret>,
        limits: Limits,
    ) -> HttpState {
        HttpState {
            telemetry,
            pool: db.pool_with_statement_timeout(
                schema,
                "outbox-relay-http",
                limits.connections,
                limits.statement,
            ),
            admin_token,
            limits,
            api_slots: Arc::new(Semaphore::new(limits.concurrent_api)),
            history: Arc::new(Mutex::new(VecDeque::with_capacity(HISTORY))),
        }
    }

    /// The newest sample, if the sampler has taken one.
    fn latest(&self) -> Option<Sample> {
        self.history.lock().expect("history lock").back().copied()
    }
}

/// Serves until `shutdown`; the sampler runs alongside. Connections still open then get
/// [`Limits::request`] to finish.
pub async fn serve(
    listener: TcpListener,
    state: HttpState,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    if let Ok(addr) = listener.local_addr()
        && !addr.ip().is_loopback()
        && state.admin_token.is_none()
    {
        tracing::warn!(
            target: "outbox_relay",
            %addr,
            "the dashboard's read-only API is open to anyone who can reach this address: set --admin-token to require it"
        );
    }
    tokio::spawn(sample(state.clone(), shutdown.clone()));
    let limits = state.limits;
    let api = Router::new()
        .route("/api/overview", get(overview))
        .route("/api/parked", get(parked))
        .route("/api/redrive", post(redrive))
        // Applied bottom-up: the token is checked first, then a slot is taken.
        .layer(middleware::from_fn_with_state(state.clone(), limited))
        .layer(middleware::from_fn_with_state(state.clone(), authorised));
    let app = Router::new()
        .route("/", get(dashboard))
        .route("/livez", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .merge(api)
        .layer(middleware::from_fn_with_state(state.clone(), timed))
        .with_state(state);

    serve_app(listener, app, limits, shutdown).await
}

/// Serves `app` on `listener` until `shutdown` with the client limits of `limits` (header
/// read time, open connections); connections still open then get [`Limits::request`] to
/// finish. The relay's endpoint and the group router's share it.
pub async fn serve_app(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read);
    let graceful = GracefulShutdown::new();
    let clients = Arc::new(Semaphore::new(limits.clients));
    loop {
        let stream = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors and the like: wait rather than spin.
                    tracing::warn!(target: "outbox_relay", error = %e, "http accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let Ok(client) = clients.clone().try_acquire_owned() else {
            tracing::debug!(target: "outbox_relay", "http connection refused: too many open");
            continue; // dropping the stream closes it
        };
        let conn =
            http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(target: "outbox_relay", error = %e, "http connection ended");
            }
            drop(client);
        });
    }
    drop(listener);
    let _ = tokio::time::timeout(limits.request, graceful.shutdown()).await;
    Ok(())
}

/// Every request gets [`Limits::request`] from its headers to its response.
async fn timed(State(state): State<HttpState>, req: Request, next: Next) -> Response {
    let limit = state.limits.request;
    match tokio::time::timeout(limit, next.run(req)).await {
        Ok(response) => response,
        Err(_) => refusal(
            StatusCode::SERVICE_UNAVAILABLE,
            &format!("request not done within {limit:?}; try again"),
        ),
    }
}

/// At most [`Limits::concurrent_api`] API requests at once; more get 503 at once.
async fn limited(State(state): State<HttpState>, req: Request, next: Next) -> Response {
    let Ok(_slot) = state.api_slots.try_acquire() else {
        let mut r = refusal(
            StatusCode::SERVICE_UNAVAILABLE,
            "too many API requests at once; try again",
        );
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        return r;
    };
    next.run(req).await
}

/// With an admin token configured, every API request must carry it.
async fn authorised(State(state): State<HttpState>, req: Request, next: Next) -> Response {
    if let Some(expected) = &state.admin_token
        && !same_token(bearer(req.headers()), expected.expose())
    {
        let mut r = refusal(StatusCode::UNAUTHORIZED, "wrong or missing admin token");
        r.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        return r;
    }
    next.run(req).await
}

fn refusal(status: StatusCode, error: &str) -> Response {
    (status, Json(json!({ "error": error }))).into_response()
}

/// The bearer token of a request, or "" without one.
fn bearer(headers: &HeaderMap) -> &str {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("")
}

async fn sample_once(state: &HttpState) -> Result<Sample, DbError> {
    let client = deadline(state.pool.get()).await?;
    Ok(Sample {
        counts: operator::counts(&client).await?,
        dispatched_total: state.telemetry.metrics.dispatched.get(),
    })
}

/// Takes a sample and keeps it for the chart and the overview.
async fn sample_and_keep(state: &HttpState) -> Result<Sample, DbError> {
    let s = sample_once(state).await?;
    state.telemetry.outbox_sampled(
        s.counts.pending,
        s.counts.oldest_pending_seconds,
        s.counts.parked,
    );
    let mut h = state.history.lock().expect("history lock");
    if h.len() == HISTORY {
        h.pop_front();
    }
    h.push_back(s);
    Ok(s)
}

async fn sample(state: HttpState, shutdown: CancellationToken) {
    let mut down = Down::new("dashboard sampler");
    loop {
        match sample_and_keep(&state).await {
            Ok(_) => {
                down.recovered();
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
    readiness(health.ready(), || health.describe())
}

/// A `/readyz` answer: 200 "ready", or 503 with why not.
pub fn readiness(ready: bool, why_not: impl FnOnce() -> String) -> Response {
    if ready {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {}\n", why_not()),
        )
            .into_response()
    }
}

async fn metrics(State(state): State<HttpState>) -> Response {
    openmetrics(state.telemetry.metrics.encode())
}

/// A `/metrics` answer in the OpenMetrics text format.
pub fn openmetrics(text: String) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// A database error: logged; its text goes only to a caller that showed the admin token
/// (with a token configured, every API caller did), others get a generic message.
fn db_error(state: &HttpState, e: DbError) -> Response {
    tracing::warn!(target: "outbox_relay", error = %e, "dashboard API: database request failed");
    let error = if state.admin_token.is_some() {
        format!("database: {e}")
    } else {
        "the database did not answer this request; the relay's log says why".to_owned()
    };
    refusal(StatusCode::SERVICE_UNAVAILABLE, &error)
}

async fn overview(State(state): State<HttpState>) -> Response {
    let latest = match state.latest() {
        Some(s) => Ok(s),
        None => sample_and_keep(&state).await, // before the sampler's first look
    };
    let counts = match latest {
        Ok(s) => s.counts,
        Err(e) => return db_error(&state, e),
    };
    let client = match deadline(state.pool.get()).await {
        Ok(c) => c,
        Err(e) => return db_error(&state, e),
    };
    let mut status = match operator::status_with(&client, &counts).await {
        Ok(s) => s,
        Err(e) => return db_error(&state, e),
    };
    let history: Vec<Value> = state
        .history
        .lock()
        .expect("history lock")
        .iter()
        .map(|s| {
            let c = &s.counts;
            json!({
                "t": c.unix, "pending": c.pending, "oldest_pending_seconds": c.oldest_pending_seconds,
                "parked": c.parked, "dispatched_total": s.dispatched_total,
            })
        })
        .collect();
    let held = |reason: &'static str| {
        state
            .telemetry
            .metrics
            .keys_held
            .get_or_create(&vec![("reason", reason)])
            .get()
    };
    status["this_relay_keys_held"] = json!({ "nack": held("nack"), "returned": held("returned") });
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
        Err(e) => return db_error(&state, e),
    };
    match operator::parked(&client, &filter, q.limit.unwrap_or(200).clamp(1, 1000)).await {
        Ok(rows) => Json(operator::parked_json(&rows)).into_response(),
        Err(e) => db_error(&state, e),
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

/// The token was checked by [`authorised`]; without one configured, nothing is re-driven.
async fn redrive(State(state): State<HttpState>, Json(body): Json<RedriveBody>) -> Response {
    if state.admin_token.is_none() {
        return refusal(
            StatusCode::FORBIDDEN,
            "read-only: start the relay with --admin-token to allow re-driving",
        );
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
        Err(e) => return db_error(&state, e),
    };
    match operator::redrive(&mut client, &filter, false).await {
        Ok(done) => {
            tracing::info!(target: "outbox_relay", rows = done.rows, keys = done.keys, "re-driven from the dashboard");
            Json(json!({ "redriven": done.rows, "summary": done.summary() })).into_response()
        }
        Err(e) => db_error(&state, e),
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
