//! `[nodes]`: each node is an address (`worker = "10.0.0.2"`) or a table that also says
//! how the head reaches it over SSH (`worker = { address = "10.0.0.2", ssh =
//! "user@10.0.0.2" }`). The addresses fill `Topology::nodes`, the SSH destinations
//! `Topology::ssh`, so everything that only wants an address reads the same map as before.

use serde::Deserialize;
use serde::de::{self, Deserializer, MapAccess, Visitor};
use std::collections::BTreeMap;

/// One node as written: an address, or its table.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeEntry {
    pub address: String,
    pub ssh: Option<String>,
}

/// A node's table; unknown keys are refused (with a "did you mean").
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NodeTable {
    address: String,
    #[serde(default)]
    ssh: Option<String>,
}

impl<'de> Deserialize<'de> for NodeEntry {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<NodeEntry, D::Error> {
        struct Either;
        impl<'de> Visitor<'de> for Either {
            type Value = NodeEntry;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an address, or a table { address = \"...\", ssh = \"user@host\" }")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<NodeEntry, E> {
                Ok(NodeEntry {
                    address: v.to_string(),
                    ssh: None,
                })
            }
            fn visit_map<M: MapAccess<'de>>(self, m: M) -> Result<NodeEntry, M::Error> {
                let t = NodeTable::deserialize(de::value::MapAccessDeserializer::new(m))?;
                Ok(NodeEntry {
                    address: t.address,
                    ssh: t.ssh,
                })
            }
        }
        d.deserialize_any(Either)
    }
}

/// `[nodes]` as name -> address, whichever form each node is written in.
pub fn addresses<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<String, String>, D::Error> {
    let entries = BTreeMap::<String, NodeEntry>::deserialize(d)?;
    Ok(entries.into_iter().map(|(n, e)| (n, e.address)).collect())
}

/// Only `[nodes]` of a topology (everything else ignored): for the SSH destinations, read
/// from the text once the whole topology has parsed.
#[derive(Deserialize)]
struct NodesOnly {
    #[serde(default)]
    nodes: BTreeMap<String, NodeEntry>,
}

/// Node name -> SSH destination, from topology text that already parsed.
pub fn ssh_destinations(text: &str) -> BTreeMap<String, String> {
    toml::from_str::<NodesOnly>(text)
        .map(|n| {
            n.nodes
                .into_iter()
                .filter_map(|(name, e)| e.ssh.map(|s| (name, s)))
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_forms_give_addresses_and_the_table_its_ssh() {
        let text = "[nodes]\nhead = \"10.0.0.1\"\nworker = { address = \"10.0.0.2\", ssh = \"root@10.0.0.2\" }\n";
        #[derive(Deserialize)]
        struct T {
            #[serde(deserialize_with = "addresses")]
            nodes: BTreeMap<String, String>,
        }
        let t: T = toml::from_str(text).unwrap();
        assert_eq!(t.nodes["worker"], "10.0.0.2");
        assert_eq!(t.nodes["head"], "10.0.0.1");
        let ssh = ssh_destinations(text);
        assert_eq!(ssh.len(), 1);
        assert_eq!(ssh["worker"], "root@10.0.0.2");
        let bad = toml::from_str::<T>("[nodes]\nw = { adress = \"x\" }\n");
        let e = bad.err().unwrap().to_string();
        assert!(e.contains("adress"), "{e}");
    }

    #[test]
    fn ssh_on_the_head_or_an_empty_destination_is_located() {
        let load = |nodes: &str| {
            let text = format!("head = \"h\"\n[nodes]\n{nodes}\n[model]\nname = \"m\"\n");
            crate::topology::load_str(
                &text,
                crate::topology::Source::Profile("t".into()),
                "t.toml".into(),
            )
        };
        let ok = load("h = \"10.0.0.1\"\nw = { address = \"10.0.0.2\", ssh = \"me@10.0.0.2\" }")
            .unwrap();
        assert_eq!(ok.spec.ssh["w"], "me@10.0.0.2");
        assert_eq!(ok.spec.nodes["w"], "10.0.0.2");
        let e = load("h = { address = \"10.0.0.1\", ssh = \"me@h\" }").unwrap_err();
        assert_eq!(e.key, "nodes.h.ssh", "{e}");
        let e = load("h = \"10.0.0.1\"\nw = { address = \"10.0.0.2\", ssh = \" \" }").unwrap_err();
        assert!(e.message.contains("not an SSH destination"), "{e}");
        let e = load("h = \"10.0.0.1\"\nw = { address = \"10.0.0.2\", ssh = \"-oProxyCommand=touch /tmp/x\" }")
            .unwrap_err();
        assert_eq!(e.key, "nodes.w.ssh", "{e}");
        assert!(e.message.contains("begins with `-`"), "{e}");
    }

    #[test]
    fn node_names_are_dns_labels() {
        let load = |name: &str| {
            let text = format!(
                "head = \"h\"\n[nodes]\nh = \"10.0.0.1\"\n\"{name}\" = \"10.0.0.2\"\n[model]\nname = \"m\"\n"
            );
            crate::topology::load_str(
                &text,
                crate::topology::Source::Profile("t".into()),
                "t.toml".into(),
            )
        };
        assert!(load("worker-2").is_ok());
        for bad in [
            "a/b",
            "..",
            "Worker",
            "w_1",
            "-w",
            &"x".repeat(64),
            &"x".repeat(200),
        ] {
            let e = load(bad).unwrap_err();
            assert_eq!(e.key, format!("nodes.{bad}"), "{e}");
            assert!(e.to_string().contains("DNS label"), "{e}");
        }
        assert!(load(&"x".repeat(63)).is_ok());
    }
}
