//! The two halves of a PD pair, and why a leg fails: the words every layer of the proxy
//! (errors, membership, the request path, the figures) names legs and failures with.

/// Which half of a PD pair an instance (or a request leg) is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Leg {
    Prefill,
    Decode,
}

impl Leg {
    /// The name used in metrics labels, logs and error bodies.
    pub fn as_str(self) -> &'static str {
        match self {
            Leg::Prefill => "prefill",
            Leg::Decode => "decode",
        }
    }
}

impl std::fmt::Display for Leg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a leg failed on an instance, as counted per instance in metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// Could not connect (refused, unreachable, connect timeout).
    Connect,
    /// Connected, but no answer in time.
    Timeout,
    /// Answered with a 5xx status.
    Status5xx,
    /// The answer broke off or could not be read.
    Body,
}

impl FailureKind {
    /// Every kind, in the order metrics print them.
    pub const ALL: [FailureKind; 4] = [
        FailureKind::Connect,
        FailureKind::Timeout,
        FailureKind::Status5xx,
        FailureKind::Body,
    ];

    /// The metrics label value.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureKind::Connect => "connect",
            FailureKind::Timeout => "timeout",
            FailureKind::Status5xx => "status_5xx",
            FailureKind::Body => "body",
        }
    }
}
