//! TLS to Postgres with libpq's `sslmode` meanings, on rustls with the ring provider.
//!
//! tokio-postgres itself knows only `disable`, `prefer` and `require`, so the connection
//! string's `sslmode` and `sslrootcert` are taken out here, and the certificate policy is
//! ours: `prefer`/`require` encrypt without checking who answers (as libpq does),
//! `verify-ca` checks the chain against `sslrootcert`, `verify-full` checks the chain and
//! the host name. Invariant: a mode that asks for TLS never falls back to plain text, and
//! a `verify-*` mode never accepts a certificate the roots do not vouch for.

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, verify_tls12_signature, verify_tls13_signature};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, Error, RootCertStore, SignatureScheme,
};
use tokio_postgres_rustls::MakeRustlsConnect;

/// libpq's `sslmode` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SslMode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl SslMode {
    fn parse(s: &str) -> Result<SslMode, String> {
        Ok(match s {
            "disable" => SslMode::Disable,
            "allow" | "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            other => {
                return Err(format!(
                    "sslmode '{other}' is not one of disable, prefer, require, verify-ca, verify-full"
                ));
            }
        })
    }

    /// What tokio-postgres is told (it then refuses to fall back for `require`).
    fn for_driver(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => "require",
        }
    }
}

/// Where trusted roots come from for `verify-*`.
#[derive(Clone)]
enum Roots {
    File(PathBuf, Arc<RootCertStore>),
    System(Arc<RootCertStore>),
}

/// The TLS policy of one Postgres target.
#[derive(Clone)]
pub(crate) struct PgTls {
    mode: SslMode,
    roots: Option<Roots>,
}

impl fmt::Debug for PgTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let roots = match &self.roots {
            None => "none".to_owned(),
            Some(Roots::File(p, _)) => p.display().to_string(),
            Some(Roots::System(_)) => "system".to_owned(),
        };
        write!(f, "PgTls({:?}, roots: {roots})", self.mode)
    }
}

impl PgTls {
    /// The connector for tokio-postgres. With `disable` it is never used.
    pub(crate) fn connector(&self) -> MakeRustlsConnect {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier: Arc<dyn ServerCertVerifier> = match (&self.roots, self.mode) {
            (
                Some(Roots::File(_, roots) | Roots::System(roots)),
                SslMode::VerifyCa | SslMode::VerifyFull,
            ) => {
                let inner =
                    WebPkiServerVerifier::builder_with_provider(roots.clone(), provider.clone())
                        .build()
                        .expect("a root store with at least one certificate");
                if self.mode == SslMode::VerifyFull {
                    inner
                } else {
                    Arc::new(ChainOnly { inner })
                }
            }
            _ => Arc::new(EncryptOnly {
                provider: provider.clone(),
            }),
        };
        let config = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("ring supports the default protocol versions")
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth();
        MakeRustlsConnect::new(config)
    }
}

/// Takes `sslmode`, `sslrootcert` (and refuses `sslcert`/`sslkey`) out of a connection
/// string in URL or key=value form. Returns the string for tokio-postgres and the policy.
pub(crate) fn split_tls_params(raw: &str) -> Result<(String, PgTls), String> {
    let is_url = raw.starts_with("postgres://") || raw.starts_with("postgresql://");
    let mut mode = None;
    let mut rootcert = None;
    let rest = if is_url {
        let (base, query) = raw.split_once('?').unwrap_or((raw, ""));
        let mut kept = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            match k {
                "sslmode" => mode = Some(percent_decode(v)?),
                "sslrootcert" => rootcert = Some(percent_decode(v)?),
                "sslcert" | "sslkey" => {
                    return Err("client certificates (sslcert, sslkey) are not supported".into());
                }
                _ => kept.push(pair.to_owned()),
            }
        }
        (base.to_owned(), kept, true)
    } else {
        let mut kept = Vec::new();
        for (k, v) in key_values(raw)? {
            match k.as_str() {
                "sslmode" => mode = Some(v),
                "sslrootcert" => rootcert = Some(v),
                "sslcert" | "sslkey" => {
                    return Err("client certificates (sslcert, sslkey) are not supported".into());
                }
                _ => kept.push(format!(
                    "{k}='{}'",
                    v.replace('\\', "\\\\").replace('\'', "\\'")
                )),
            }
        }
        (String::new(), kept, false)
    };
    let mode = SslMode::parse(mode.as_deref().unwrap_or("prefer"))?;
    let roots = match (mode, rootcert.as_deref()) {
        (SslMode::VerifyCa | SslMode::VerifyFull, None) => {
            return Err("sslmode=verify-ca and verify-full need sslrootcert=<PEM file> (or sslrootcert=system)".into());
        }
        (SslMode::VerifyCa | SslMode::VerifyFull, Some("system")) => {
            Some(Roots::System(Arc::new(system_roots()?)))
        }
        (SslMode::VerifyCa | SslMode::VerifyFull, Some(path)) => {
            let path = PathBuf::from(path);
            Some(Roots::File(path.clone(), Arc::new(file_roots(&path)?)))
        }
        _ => None,
    };
    let (base, mut kept, url) = rest;
    let rebuilt = if url {
        kept.push(format!("sslmode={}", mode.for_driver()));
        format!("{base}?{}", kept.join("&"))
    } else {
        kept.push(format!("sslmode={}", mode.for_driver()));
        kept.join(" ")
    };
    Ok((rebuilt, PgTls { mode, roots }))
}

fn file_roots(path: &std::path::Path) -> Result<RootCertStore, String> {
    let pem = std::fs::read(path)
        .map_err(|e| format!("cannot read sslrootcert {}: {e}", path.display()))?;
    let mut store = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&pem) {
        let cert = cert.map_err(|e| format!("sslrootcert {} is not PEM: {e}", path.display()))?;
        store.add(cert).map_err(|e| {
            format!(
                "sslrootcert {} holds an unusable certificate: {e}",
                path.display()
            )
        })?;
    }
    if store.is_empty() {
        return Err(format!(
            "sslrootcert {} holds no certificate",
            path.display()
        ));
    }
    Ok(store)
}

fn system_roots() -> Result<RootCertStore, String> {
    let found = rustls_native_certs::load_native_certs();
    let mut store = RootCertStore::empty();
    let (added, _) = store.add_parsable_certificates(found.certs);
    if added == 0 {
        return Err("sslrootcert=system, but the system has no trusted certificates".into());
    }
    Ok(store)
}

fn percent_decode(s: &str) -> Result<String, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex =
                std::str::from_utf8(&bytes[i + 1..i + 3]).map_err(|_| "bad percent-encoding")?;
            out.push(u8::from_str_radix(hex, 16).map_err(|_| "bad percent-encoding")?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| "percent-encoding is not UTF-8".into())
}

/// libpq's key=value syntax: `host=x port=5432 password='a b'`.
fn key_values(raw: &str) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    let mut chars = raw.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.peek().is_none() {
            return Ok(out);
        }
        let mut key = String::new();
        while let Some(&c) = chars.peek() {
            if c == '=' || c.is_whitespace() {
                break;
            }
            key.push(c);
            chars.next();
        }
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.next() != Some('=') {
            return Err(format!("'{key}' has no value (write key=value)"));
        }
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        let mut value = String::new();
        if chars.peek() == Some(&'\'') {
            chars.next();
            loop {
                match chars.next() {
                    Some('\\') => value.extend(chars.next()),
                    Some('\'') => break,
                    Some(c) => value.push(c),
                    None => return Err(format!("unterminated quote in the value of '{key}'")),
                }
            }
        } else {
            while let Some(&c) = chars.peek() {
                if c.is_whitespace() {
                    break;
                }
                value.push(c);
                chars.next();
            }
        }
        out.push((key, value));
    }
}

/// `prefer`/`require`: encrypt, but (as libpq) do not check who answers.
#[derive(Debug)]
struct EncryptOnly {
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for EncryptOnly {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// `verify-ca`: the chain must lead to a trusted root; the host name is not checked.
#[derive(Debug)]
struct ChainOnly {
    inner: Arc<WebPkiServerVerifier>,
}

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, Error> {
        // webpki checks the chain before the name, so a name error means the chain passed.
        match self
            .inner
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            Err(Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// True when `e`'s causes include a TLS certificate rejection (waiting will not fix it).
pub(crate) fn is_certificate_error(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(Error::InvalidCertificate(_)) = err.downcast_ref::<Error>() {
            return true;
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>()
            && let Some(inner) = io.get_ref()
            && let Some(Error::InvalidCertificate(_)) = inner.downcast_ref::<Error>()
        {
            return true;
        }
        cur = err.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_params_are_split_and_verify_modes_become_require() {
        let (rest, tls) =
            split_tls_params("postgres://u:p@h:5432/db?sslmode=require&application_name=x")
                .unwrap();
        assert_eq!(tls.mode, SslMode::Require);
        assert_eq!(
            rest,
            "postgres://u:p@h:5432/db?application_name=x&sslmode=require"
        );
        let (rest, tls) = split_tls_params("postgres://h/db").unwrap();
        assert_eq!(tls.mode, SslMode::Prefer);
        assert_eq!(rest, "postgres://h/db?sslmode=prefer");
    }

    #[test]
    fn key_value_form_is_split_with_quotes() {
        let (rest, tls) =
            split_tls_params("host=h dbname=d password='a b\\'c' sslmode=disable").unwrap();
        assert_eq!(tls.mode, SslMode::Disable);
        assert_eq!(
            rest,
            "host='h' dbname='d' password='a b\\'c' sslmode=disable"
        );
    }

    #[test]
    fn bad_tls_settings_are_refused_with_a_reason() {
        assert!(
            split_tls_params("postgres://h/db?sslmode=sometimes")
                .unwrap_err()
                .contains("sslmode 'sometimes'")
        );
        assert!(
            split_tls_params("postgres://h/db?sslmode=verify-full")
                .unwrap_err()
                .contains("sslrootcert")
        );
        assert!(
            split_tls_params("postgres://h/db?sslmode=verify-ca&sslrootcert=/nonexistent.pem")
                .unwrap_err()
                .contains("cannot read sslrootcert")
        );
        assert!(
            split_tls_params("postgres://h/db?sslcert=x")
                .unwrap_err()
                .contains("not supported")
        );
    }

    #[test]
    fn percent_decoding() {
        assert_eq!(percent_decode("%2Fetc%2Fca.pem").unwrap(), "/etc/ca.pem");
        assert_eq!(percent_decode("plain").unwrap(), "plain");
    }
}
