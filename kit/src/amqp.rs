//! The broker connection both sides use: where the broker is ([`AmqpTarget`], one URL or a
//! cluster's list), connecting with a deadline, one AMQP round trip with a deadline
//! (`rpc`), and the declarations the relay and the consumer kit share.
//!
//! Invariant: every network await here has a deadline (`CONNECT_TIMEOUT`, `RPC_TIMEOUT`,
//! 15 s each).

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use lapin::options::ExchangeDeclareOptions;
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::uri::AMQPUri;
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};

/// Where the broker is: one URL, or several (a cluster) tried in order. Debug and Display
/// never show the password.
#[derive(Clone)]
pub struct AmqpTarget {
    uris: Vec<AMQPUri>,
    /// Extra trusted CA certificates (PEM) for amqps://, besides the system's.
    ca_pem: Option<String>,
    /// The URL to try first next time: the one that last worked. Shared by clones, so a
    /// reconnect starts where the last success was.
    next: Arc<std::sync::atomic::AtomicUsize>,
}

impl fmt::Debug for AmqpTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AmqpTarget({self})")
    }
}

impl fmt::Display for AmqpTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, uri) in self.uris.iter().enumerate() {
            let scheme = match uri.scheme {
                lapin::uri::AMQPScheme::AMQP => "amqp",
                lapin::uri::AMQPScheme::AMQPS => "amqps",
            };
            let a = &uri.authority;
            let sep = if i == 0 { "" } else { "," };
            let host = if a.host.contains(':') {
                format!("[{}]", a.host)
            } else {
                a.host.clone()
            };
            write!(
                f,
                "{sep}{scheme}://{}@{host}:{}/{}",
                a.userinfo.username, a.port, uri.vhost
            )?;
        }
        Ok(())
    }
}

impl AmqpTarget {
    /// One URL, or several separated by commas: the nodes of a cluster, tried in that
    /// order (after a failure the next one; after a success that one first).
    pub fn parse(raw: &str) -> Result<AmqpTarget, String> {
        let mut uris = Vec::new();
        for one in raw.split(',').map(str::trim) {
            uris.push(Self::parse_one(one)?);
        }
        if uris.windows(2).any(|w| w[0].scheme != w[1].scheme) {
            return Err(
                "all URLs of the list must use the same scheme (amqp:// or amqps://)".into(),
            );
        }
        Ok(AmqpTarget {
            uris,
            ca_pem: None,
            next: Arc::default(),
        })
    }

    fn parse_one(raw: &str) -> Result<AMQPUri, String> {
        if !(raw.starts_with("amqp://") || raw.starts_with("amqps://")) {
            return Err(
                "must start with amqp:// or amqps:// (several URLs: separate them with commas)"
                    .into(),
            );
        }
        let mut uri = AMQPUri::from_str(raw).map_err(|e| format!("not a valid AMQP URL ({e})"))?;
        // The AMQP URI parser takes the host from `Url::domain`, which is empty for an IPv6
        // literal, and then falls back to "localhost": `amqp://u:p@[fd00::5]/` would send
        // the credentials to whatever listens on this machine. Take an IP literal from the
        // URL ourselves (the connect resolves a bare "fd00::5" with the port as an address).
        let parsed = url::Url::parse(raw).ok();
        if let Some(url::Host::Ipv6(ip)) = parsed.as_ref().and_then(url::Url::host) {
            uri.authority.host = ip.to_string();
        }
        if uri.authority.host.is_empty() {
            return Err("names no host; write it like amqp://user:pass@host:5672/%2f".into());
        }
        // A dead peer must be noticed: heartbeats every 10 s unless the URL says otherwise.
        uri.query.heartbeat.get_or_insert(10);
        uri.query.connection_timeout.get_or_insert(10_000);
        Ok(uri)
    }

    /// Trusts the CA certificates in the PEM file `path` for amqps:// connections.
    pub fn with_ca_file(mut self, path: &std::path::Path) -> Result<AmqpTarget, String> {
        if self.uris[0].scheme != lapin::uri::AMQPScheme::AMQPS {
            return Err("a CA file needs an amqps:// URL".into());
        }
        let pem = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        if !pem.contains("-----BEGIN CERTIFICATE-----") {
            return Err(format!("{} holds no PEM certificate", path.display()));
        }
        self.ca_pem = Some(pem);
        Ok(self)
    }

    /// The same broker on another port (tests point the relay at a proxy).
    pub fn with_port(&self, port: u16) -> AmqpTarget {
        let mut t = self.clone();
        t.next = Arc::default();
        for uri in &mut t.uris {
            uri.authority.port = port;
        }
        t
    }

    /// Connects to the first URL that answers, starting with the one that last worked.
    pub async fn connect(&self, name: &str) -> Result<Connection, AmqpError> {
        Ok(self.connect_node(name).await?.0)
    }

    /// [`AmqpTarget::connect`], also saying which node of the list (its index) answered.
    pub(crate) async fn connect_node(&self, name: &str) -> Result<(Connection, usize), AmqpError> {
        use std::sync::atomic::Ordering;
        let start = self.preferred_node();
        let mut last = None;
        for i in 0..self.uris.len() {
            let at = (start + i) % self.uris.len();
            match self.connect_to(&self.uris[at], name).await {
                Ok(conn) => {
                    self.next.store(at, Ordering::Relaxed);
                    return Ok((conn, at));
                }
                Err(e) => {
                    if self.uris.len() > 1 {
                        tracing::debug!(target: "outbox_relay", node = at, error = %e, "broker node unreachable; trying the next");
                    }
                    last = Some(e);
                }
            }
        }
        self.next
            .store((start + 1) % self.uris.len(), Ordering::Relaxed);
        Err(last.expect("at least one URL"))
    }

    /// The node (index into the list) the next connect tries first: the one that last
    /// worked, unless it was given up on.
    pub fn preferred_node(&self) -> usize {
        self.next.load(std::sync::atomic::Ordering::Relaxed) % self.uris.len()
    }

    /// A session on `node` was given up although the node answers (it refused every publish
    /// for a confirm timeout): the next connect starts with the node after it, and comes back
    /// to `node` only after the others. Does nothing if a connect has moved on meanwhile.
    pub fn give_up_on(&self, node: usize) {
        use std::sync::atomic::Ordering;
        let after = (node + 1) % self.uris.len();
        let _ = self
            .next
            .compare_exchange(node, after, Ordering::Relaxed, Ordering::Relaxed);
    }

    async fn connect_to(&self, uri: &AMQPUri, name: &str) -> Result<Connection, AmqpError> {
        let props = ConnectionProperties::default().with_connection_name(name.into());
        // Extra trusted roots for amqps:// (the system's are always trusted too).
        let tls = lapin::tcp::OwnedTLSConfig {
            identity: None,
            cert_chain: self.ca_pem.clone(),
        };
        let connect = Connection::connect_uri_with_config(
            uri.clone(),
            props,
            tls,
            lapin::runtime::default_runtime()?,
        );
        let conn = tokio::time::timeout(CONNECT_TIMEOUT, connect)
            .await
            .map_err(|_| AmqpError::Timeout("connect"))??;
        Ok(conn)
    }
}

/// lapin's log targets that print message bodies (users' data), each with the most verbose
/// level at which it does not: `lapin::returned_messages` logs every returned message, body
/// included, at WARN; `lapin::channels` and `lapin::frames` dump frames, bodies included, at
/// TRACE. The relay caps them whatever `RUST_LOG` says unless a directive names the target;
/// a service running the consumer kit should cap them in its own log filter
/// (`lapin::returned_messages=error,lapin::channels=debug,lapin::frames=debug`).
pub const PAYLOAD_LOG_TARGETS: [(&str, tracing::Level); 3] = [
    ("lapin::returned_messages", tracing::Level::ERROR),
    ("lapin::channels", tracing::Level::DEBUG),
    ("lapin::frames", tracing::Level::DEBUG),
];

const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);
const RPC_TIMEOUT: Duration = Duration::from_secs(15);

/// An AMQP failure at the module boundary.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AmqpError {
    /// The connection or a channel failed.
    #[error("rabbitmq: {0}")]
    Amqp(#[from] lapin::Error),
    /// The broker did not answer in time.
    #[error("rabbitmq: no answer to {0} in time")]
    Timeout(&'static str),
}

pub(crate) use plumbing::rpc;

/// Shared with the relay through [`crate::internal`]; not part of the kit's API.
pub(crate) mod plumbing {
    use super::{AmqpError, AmqpTarget, Connection, RPC_TIMEOUT};

    /// One AMQP round trip with the standard deadline; no answer in time is
    /// [`AmqpError::Timeout`].
    pub async fn rpc<T>(
        what: &'static str,
        fut: impl Future<Output = lapin::Result<T>>,
    ) -> Result<T, AmqpError> {
        match tokio::time::timeout(RPC_TIMEOUT, fut).await {
            Ok(r) => Ok(r?),
            Err(_) => Err(AmqpError::Timeout(what)),
        }
    }

    /// [`AmqpTarget::connect`], also saying which node of the list (its index) answered, for
    /// [`AmqpTarget::give_up_on`].
    pub async fn connect_node(
        target: &AmqpTarget,
        name: &str,
    ) -> Result<(Connection, usize), AmqpError> {
        target.connect_node(name).await
    }
}

/// Resolves, with the reason, when `conn` fails at the connection level (heartbeat timeout,
/// the broker closing it) or its event stream ends. Owns what it listens to, so a session
/// can spawn it beside its own stop signal: connection failures then end the session even
/// while none of its channels is waiting on the broker.
pub fn connection_lost(conn: &Connection) -> impl Future<Output = String> + Send + 'static {
    use futures_util::StreamExt;
    let events = conn.events_listener();
    async move {
        let mut events = std::pin::pin!(events);
        loop {
            match events.next().await {
                Some(lapin::Event::Error(e)) => return format!("connection error: {e}"),
                Some(_) => {}
                None => return "connection closed".to_owned(),
            }
        }
    }
}

/// Closes a connection whose channel setup failed, giving the broker 2 s to answer.
pub async fn close_after_failed_setup(conn: &Connection) {
    let _ = tokio::time::timeout(
        Duration::from_secs(2),
        conn.close(320, "setup failed".into()),
    )
    .await;
}

/// An AMQP long string (the type RabbitMQ's plugins expect for text arguments and headers).
pub fn long_string(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()))
}

/// Declares a durable exchange of `kind` (idempotent; refused by the broker when it exists
/// with other properties). `passive`: only check that it exists (the relay's `--no-declare`).
pub async fn declare_exchange(
    ch: &Channel,
    name: &str,
    kind: ExchangeKind,
    passive: bool,
) -> Result<(), AmqpError> {
    let durable = ExchangeDeclareOptions {
        durable: true,
        passive,
        ..ExchangeDeclareOptions::default()
    };
    rpc(
        "exchange.declare",
        ch.exchange_declare(name.into(), kind, durable, FieldTable::default()),
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_list_is_a_failover_order() {
        let t =
            AmqpTarget::parse("amqp://u:secret@a:5672/%2f, amqp://u:secret@b:5673/%2f").unwrap();
        assert_eq!(t.uris.len(), 2);
        assert_eq!(t.to_string(), "amqp://u@a:5672//,amqp://u@b:5673//");
        assert!(
            AmqpTarget::parse("amqp://a/%2f,amqps://b/%2f").is_err(),
            "one scheme"
        );
        assert!(
            AmqpTarget::parse("amqp://a/%2f,").is_err(),
            "no empty entries"
        );
    }

    /// After a success the next connect starts with that node; a node given up on (it nacked
    /// everything) is tried after the others, wrapping around the list; a stale give-up
    /// (another node already preferred) changes nothing.
    #[test]
    fn a_node_given_up_on_is_tried_after_the_others() {
        use std::sync::atomic::Ordering;
        let t = AmqpTarget::parse("amqp://a/%2f,amqp://b/%2f,amqp://c/%2f").unwrap();
        assert_eq!(t.preferred_node(), 0);
        t.next.store(1, Ordering::Relaxed); // b worked last
        assert_eq!(t.preferred_node(), 1);
        t.give_up_on(1);
        assert_eq!(
            t.preferred_node(),
            2,
            "the next node, not the one that nacked"
        );
        t.give_up_on(1);
        assert_eq!(t.preferred_node(), 2, "a stale give-up changes nothing");
        t.give_up_on(2);
        assert_eq!(t.preferred_node(), 0, "wraps around");
        let single = AmqpTarget::parse("amqp://a/%2f").unwrap();
        single.give_up_on(0);
        assert_eq!(single.preferred_node(), 0, "one node: nothing else to try");
    }

    #[test]
    fn an_ipv6_broker_address_is_kept() {
        let t = AmqpTarget::parse("amqp://u:secret@[fd00::5]:5673/%2f").unwrap();
        assert_eq!(t.uris[0].authority.host, "fd00::5");
        assert_eq!(t.to_string(), "amqp://u@[fd00::5]:5673//");
        let t = AmqpTarget::parse("amqp://u:secret@[::1]/%2f").unwrap();
        assert_eq!(t.to_string(), "amqp://u@[::1]:5672//");
    }

    /// The connection really goes to the IPv6 address, not to "localhost": a listener on
    /// [::1] sees it arrive (the handshake then fails: nothing there speaks AMQP).
    #[tokio::test]
    async fn an_ipv6_broker_address_is_where_it_connects() {
        let listener = tokio::net::TcpListener::bind("[::1]:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let target = AmqpTarget::parse(&format!(
            "amqp://u:p@[::1]:{port}/%2f?connection_timeout=2000"
        ))
        .unwrap();
        let connect = tokio::spawn(async move { target.connect("ipv6-test").await.is_err() });
        let accepted = tokio::time::timeout(Duration::from_secs(10), listener.accept()).await;
        assert!(accepted.is_ok(), "nothing connected to [::1]:{port}");
        drop(accepted);
        assert!(connect.await.unwrap(), "no broker there: the connect fails");
    }
}
