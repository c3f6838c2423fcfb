//! TLS for tests: a throw-away CA, and TLS-terminating proxies in front of the local
//! RabbitMQ (plain TLS) and Postgres (TLS after Postgres' SSLRequest), so the relay's
//! client-side TLS is tested against certificates the test controls.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// A CA and a server certificate it signed for `localhost` and `127.0.0.1`.
pub struct TestCa {
    pub ca_pem_file: PathBuf,
    cert: CertificateDer<'static>,
    key: Vec<u8>,
}

impl TestCa {
    pub fn new(name: &str) -> TestCa {
        let ca_key = KeyPair::generate().unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "outbox-relay test CA");
        let ca = CertifiedIssuer::self_signed(ca_params, ca_key).unwrap();
        let key = KeyPair::generate().unwrap();
        let params =
            CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).unwrap();
        let cert = params.signed_by(&key, &ca).unwrap();
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("tls");
        std::fs::create_dir_all(&dir).unwrap();
        let ca_pem_file = dir.join(format!("{name}-ca.pem"));
        std::fs::write(&ca_pem_file, ca.pem()).unwrap();
        TestCa {
            ca_pem_file,
            cert: cert.der().clone(),
            key: key.serialize_der(),
        }
    }

    fn acceptor(&self) -> TlsAcceptor {
        let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
        let config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![self.cert.clone()],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key.clone())),
            )
            .unwrap();
        TlsAcceptor::from(Arc::new(config))
    }
}

/// What the proxy does before TLS.
#[derive(Clone, Copy)]
pub enum Preamble {
    /// Plain TLS (AMQPS).
    None,
    /// Postgres: answer the client's SSLRequest with 'S', then TLS.
    PostgresSslRequest,
}

/// Terminates TLS on 127.0.0.1:<port> and forwards the plain bytes to `upstream`.
pub async fn tls_proxy(ca: &TestCa, upstream: SocketAddr, preamble: Preamble) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let acceptor = ca.acceptor();
    tokio::spawn(async move {
        loop {
            let Ok((mut client, _)) = listener.accept().await else {
                return;
            };
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                if let Preamble::PostgresSslRequest = preamble {
                    let mut request = [0u8; 8];
                    if client.read_exact(&mut request).await.is_err()
                        || request != [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f]
                    {
                        return; // not an SSLRequest: this proxy only speaks TLS
                    }
                    if client.write_all(b"S").await.is_err() {
                        return;
                    }
                }
                let Ok(mut tls) = acceptor.accept(client).await else {
                    return;
                };
                let Ok(mut server) = TcpStream::connect(upstream).await else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut server).await;
            });
        }
    });
    addr
}
