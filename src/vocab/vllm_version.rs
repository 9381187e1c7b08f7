//! vLLM versions as values: parsing, comparing, ranges, and where a plan's version came
//! from. Lives in `vocab` because a topology pins one, every connector template is keyed
//! on a range of them and the planner records one; asking a Python which version it has
//! (I/O) stays in [`crate::vllm`].

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// A vLLM release as major.minor.patch; suffixes such as `.post1`, `rc2` or `+cpu` are
/// kept for display but do not take part in comparisons.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Version {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
    /// The text as written (e.g. `0.10.1.post1+cpu`).
    pub text: String,
}

impl Version {
    /// A version from its numbers (for ranges and tests).
    pub const fn new(major: u32, minor: u32, patch: u32) -> Version {
        Version {
            major,
            minor,
            patch,
            text: String::new(),
        }
    }

    fn key(&self) -> (u32, u32, u32) {
        (self.major, self.minor, self.patch)
    }
}

impl PartialEq for Version {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}
impl Eq for Version {}
impl PartialOrd for Version {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Version {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.key().cmp(&other.key())
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.text.is_empty() {
            write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
        } else {
            f.write_str(&self.text)
        }
    }
}

/// A version string that is not `MAJOR.MINOR[.PATCH][suffix]`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a vLLM version (expected e.g. 0.9.2, 0.10.1.post1, 0.32.0+cpu)")]
pub struct BadVersion(pub String);

impl FromStr for Version {
    type Err = BadVersion;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        let bad = || BadVersion(s.to_string());
        let t_noprefix = t.strip_prefix('v').unwrap_or(t);
        let mut nums = [0u32; 3];
        let mut rest = t_noprefix;
        for (i, slot) in nums.iter_mut().enumerate() {
            let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
            if digits.is_empty() {
                if i < 2 {
                    return Err(bad());
                }
                break;
            }
            *slot = digits.parse().map_err(|_| bad())?;
            rest = &rest[digits.len()..];
            if i < 2 {
                match rest.strip_prefix('.') {
                    Some(r) => rest = r,
                    None if i == 1 => break,
                    None => return Err(bad()),
                }
            }
        }
        Ok(Version {
            major: nums[0],
            minor: nums[1],
            patch: nums[2],
            text: t.to_string(),
        })
    }
}

/// An inclusive range of versions a template serves; `None` ends are open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VersionRange {
    pub min: Option<(u32, u32, u32)>,
    pub max: Option<(u32, u32, u32)>,
}

impl VersionRange {
    /// `min..=max`.
    pub const fn between(min: (u32, u32, u32), max: (u32, u32, u32)) -> Self {
        VersionRange {
            min: Some(min),
            max: Some(max),
        }
    }
    /// `min..`.
    pub const fn from(min: (u32, u32, u32)) -> Self {
        VersionRange {
            min: Some(min),
            max: None,
        }
    }
    /// True when `v` lies in the range.
    pub fn contains(&self, v: &Version) -> bool {
        self.min.is_none_or(|m| v.key() >= m) && self.max.is_none_or(|m| v.key() <= m)
    }
}

impl fmt::Display for VersionRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // A patch of 99 or more stands for "every patch release of a.b".
        let show = |(a, b, c): (u32, u32, u32)| {
            if c >= 99 {
                format!("{a}.{b}.x")
            } else {
                format!("{a}.{b}.{c}")
            }
        };
        match (self.min, self.max) {
            (Some(a), Some(b)) => write!(f, "{} to {}", show(a), show(b)),
            (Some(a), None) => write!(f, "{} and later", show(a)),
            (None, Some(b)) => write!(f, "up to {}", show(b)),
            (None, None) => f.write_str("every version"),
        }
    }
}
/// Where the vLLM version a plan is made for came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VersionSource {
    /// Read from the vLLM installed in `engine.python` (`vllm_version = "auto"`).
    Installed,
    /// Written in the topology.
    Pinned,
    /// `"auto"` found no vLLM: the newest version pdctl has templates for. A plan made
    /// so can be read but not run (`up` refuses it).
    Assumed,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &str) -> Version {
        s.parse().unwrap()
    }

    #[test]
    fn parses_the_forms_vllm_ships() {
        assert_eq!(v("0.9.2"), Version::new(0, 9, 2));
        assert_eq!(v("0.10.1.post1"), Version::new(0, 10, 1));
        assert_eq!(v("0.11.0rc2"), Version::new(0, 11, 0));
        assert_eq!(v("0.32.0+cpu"), Version::new(0, 32, 0));
        assert_eq!(v("v0.13"), Version::new(0, 13, 0));
        assert_eq!(v("0.10.1.post1").to_string(), "0.10.1.post1");
    }

    #[test]
    fn rejects_what_is_not_a_version() {
        for bad in ["", "auto", "latest", "0", "x.y.z", "0.x"] {
            assert!(bad.parse::<Version>().is_err(), "{bad} parsed");
        }
    }

    #[test]
    fn orders_numerically_not_textually() {
        assert!(v("0.10.0") > v("0.9.2"));
        assert!(v("0.13.0") > v("0.12.9"));
    }

    #[test]
    fn ranges_are_inclusive_and_say_what_they_cover() {
        let r = VersionRange::between((0, 9, 0), (0, 12, 0));
        assert!(r.contains(&v("0.9.0")) && r.contains(&v("0.12.0.post1")));
        assert!(!r.contains(&v("0.13.0")) && !r.contains(&v("0.8.5")));
        assert_eq!(r.to_string(), "0.9.0 to 0.12.0");
        assert_eq!(
            VersionRange::from((0, 13, 0)).to_string(),
            "0.13.0 and later"
        );
    }
}
