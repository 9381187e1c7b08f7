//! Pinning a request to instances through the OpenAI `user` field, the way users already
//! do by hand: `"user": "prefill=HOST:PORT;decode=HOST:PORT"` (either part alone is fine).

use super::errors::ProxyError;
use super::instances::{Instance, Leg, Pools};
use std::sync::Arc;

/// The instances a request asked for; `None` leaves that leg to the policy.
#[derive(Debug, Default, Clone)]
pub struct Designation {
    pub prefill: Option<Arc<Instance>>,
    pub decode: Option<Arc<Instance>>,
}

impl Designation {
    /// The instance pinned for `leg`, if any.
    pub fn of(&self, leg: Leg) -> Option<&Arc<Instance>> {
        match leg {
            Leg::Prefill => self.prefill.as_ref(),
            Leg::Decode => self.decode.as_ref(),
        }
    }
}

/// Reads a designation from the `user` field. A `user` value that is not a designation
/// (an ordinary end-user id) is left alone; a designation naming an instance that is not
/// configured is a 400 that names it and lists the configured ones.
pub fn parse(user: Option<&str>, pools: &Pools) -> Result<Designation, ProxyError> {
    let Some(user) = user else {
        return Ok(Designation::default());
    };
    let looks_like_designation = user.split(';').any(|part| {
        let key = part.split('=').next().unwrap_or("").trim();
        key.eq_ignore_ascii_case("prefill") || key.eq_ignore_ascii_case("decode")
    }) && user.contains('=');
    if !looks_like_designation {
        return Ok(Designation::default());
    }
    let mut d = Designation::default();
    for part in user.split(';').map(str::trim).filter(|p| !p.is_empty()) {
        let Some((key, value)) = part.split_once('=') else {
            return Err(bad(format!(
                "`user` designation part {part:?} has no `=`: write \"prefill=HOST:PORT;decode=HOST:PORT\""
            )));
        };
        let leg = match key.trim().to_ascii_lowercase().as_str() {
            "prefill" => Leg::Prefill,
            "decode" => Leg::Decode,
            other => {
                return Err(bad(format!(
                    "`user` designation key {other:?} is unknown: use `prefill=` and/or `decode=`"
                )));
            }
        };
        let value = value.trim();
        let value = value.strip_prefix("http://").unwrap_or(value);
        let value = value.trim_end_matches('/');
        let found = pools.find(leg, value).ok_or_else(|| {
            let known: Vec<&str> = pools.of(leg).iter().map(|i| i.host_port.as_str()).collect();
            bad(format!(
                "`user` designates {leg} instance {value:?}, which this proxy does not know; configured {leg} instances: {}",
                known.join(", ")
            ))
        })?;
        let slot = match leg {
            Leg::Prefill => &mut d.prefill,
            Leg::Decode => &mut d.decode,
        };
        if slot.is_some() {
            return Err(bad(format!(
                "`user` designates the {leg} instance twice: give `{leg}=` once"
            )));
        }
        *slot = Some(found.clone());
    }
    Ok(d)
}

fn bad(message: String) -> ProxyError {
    ProxyError::BadRequest {
        message,
        param: Some("user"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::instances::parse_endpoint;

    fn pools() -> Pools {
        let mk =
            |leg, i, s: &str| Arc::new(Instance::new(leg, i, parse_endpoint(s).unwrap(), None));
        Pools {
            prefill: vec![
                mk(Leg::Prefill, 0, "10.0.13.1:8100"),
                mk(Leg::Prefill, 1, "10.0.13.1:8101"),
            ],
            decode: vec![mk(Leg::Decode, 0, "10.0.14.1:8200")],
        }
    }

    #[test]
    fn the_seed_spelling_pins_both_legs() {
        let p = pools();
        let d = parse(Some("prefill=10.0.13.1:8101;decode=10.0.14.1:8200"), &p).unwrap();
        assert_eq!(d.prefill.unwrap().index, 1);
        assert_eq!(d.decode.unwrap().index, 0);
    }

    #[test]
    fn either_part_alone_is_enough() {
        let p = pools();
        let d = parse(Some("decode=http://10.0.14.1:8200"), &p).unwrap();
        assert!(d.prefill.is_none() && d.decode.is_some());
    }

    #[test]
    fn an_ordinary_user_id_is_not_a_designation() {
        let p = pools();
        for u in ["alice", "team=ml", ""] {
            let d = parse(Some(u), &p).unwrap();
            assert!(d.prefill.is_none() && d.decode.is_none(), "{u}");
        }
    }

    #[test]
    fn an_unknown_instance_is_named_in_the_error() {
        let p = pools();
        let e = parse(Some("prefill=10.0.13.9:8100"), &p).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("10.0.13.9:8100"), "{msg}");
        assert!(msg.contains("10.0.13.1:8100, 10.0.13.1:8101"), "{msg}");
        assert_eq!(e.status(), 400);
    }

    #[test]
    fn a_prefill_address_is_not_accepted_as_decode() {
        let p = pools();
        assert!(parse(Some("decode=10.0.13.1:8100"), &p).is_err());
    }
}
