//! Engine addresses as users write them (`http://HOST:PORT`, `HOST:PORT`), checked and
//! normalized once, so designation, the supervisor feed and metrics all compare the same
//! spelling.

/// A parsed `--prefill` / `--decode` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub url: String,
    pub host: String,
    pub port: u16,
}

/// Why an endpoint string is not usable.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EndpointError {
    #[error("{0:?} is not a URL: write http://HOST:PORT or HOST:PORT")]
    Malformed(String),
    #[error("{0:?} uses {1}: engines are reached over plain http:// only")]
    Scheme(String, String),
    #[error("{0:?} has no port: write HOST:PORT (vLLM listens on 8000 by default)")]
    NoPort(String),
    #[error("{0:?} has a path: give the engine's base URL, without /v1/...")]
    Path(String),
}

/// Parses `http://HOST:PORT`, `HOST:PORT` (or with a trailing slash) into an endpoint.
pub fn parse_endpoint(raw: &str) -> Result<Endpoint, EndpointError> {
    let trimmed = raw.trim();
    let with_scheme = if trimmed.contains("://") {
        trimmed.to_string()
    } else {
        format!("http://{trimmed}")
    };
    let url =
        reqwest::Url::parse(&with_scheme).map_err(|_| EndpointError::Malformed(raw.to_string()))?;
    if url.scheme() != "http" {
        return Err(EndpointError::Scheme(
            raw.to_string(),
            url.scheme().to_string(),
        ));
    }
    let host = url
        .host_str()
        .filter(|h| !h.is_empty())
        .ok_or_else(|| EndpointError::Malformed(raw.to_string()))?
        .to_string();
    if url.path() != "/" || url.query().is_some() {
        return Err(EndpointError::Path(raw.to_string()));
    }
    // Url drops the port when it is the scheme default, so look at what was written.
    let port = match url.port() {
        Some(p) => p,
        None if trimmed.trim_end_matches('/').ends_with(":80") => 80,
        None => return Err(EndpointError::NoPort(raw.to_string())),
    };
    Ok(Endpoint {
        url: format!("http://{host}:{port}"),
        host,
        port,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_accept_the_spellings_users_write() {
        for raw in [
            "http://127.0.0.1:8100",
            "127.0.0.1:8100",
            "http://127.0.0.1:8100/",
        ] {
            let e = parse_endpoint(raw).unwrap();
            assert_eq!(e.url, "http://127.0.0.1:8100", "{raw}");
            assert_eq!(e.port, 8100);
        }
        assert_eq!(
            parse_endpoint("gpu-a:80").unwrap().url,
            "http://gpu-a:80",
            "the default port must not vanish"
        );
    }

    #[test]
    fn endpoints_reject_what_cannot_work_with_a_reason() {
        assert!(matches!(
            parse_endpoint("https://h:1"),
            Err(EndpointError::Scheme(..))
        ));
        assert!(matches!(
            parse_endpoint("localhost"),
            Err(EndpointError::NoPort(..))
        ));
        assert!(matches!(
            parse_endpoint("http://h:8000/v1/completions"),
            Err(EndpointError::Path(..))
        ));
        assert!(matches!(
            parse_endpoint("h:notaport"),
            Err(EndpointError::Malformed(..))
        ));
    }
}
