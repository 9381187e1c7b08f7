//! Built-in topologies: the files under profiles/, compiled into the binary so `-p NAME`
//! works from any directory.

/// One built-in profile.
#[derive(Debug, Clone, Copy)]
pub struct Profile {
    pub name: &'static str,
    pub text: &'static str,
}

macro_rules! profiles {
    ($($name:literal),* $(,)?) => {
        /// Every built-in profile, in the order `pdctl profiles` lists them.
        pub const ALL: &[Profile] = &[
            $(Profile { name: $name, text: include_str!(concat!("../profiles/", $name, ".toml")) },)*
        ];
    };
}

profiles!(
    "sim-1p1d",
    "sim-4p4d",
    "1p1d",
    "1gpu-1p1d",
    "4p4d",
    "2node-4p4d",
    "nixl-1p1d",
    "mooncake-1p1d",
    "mooncake-te-1p1d",
    "mooncake-store-4p4d",
    "lmcache-1p1d",
    "shared-storage-1p1d",
    "cpu-1p1d",
);

/// The profile of that name.
pub fn get(name: &str) -> Option<&'static Profile> {
    ALL.iter().find(|p| p.name == name)
}

impl Profile {
    /// The profile's `description` line.
    pub fn description(&self) -> String {
        toml::from_str::<toml::Table>(self.text)
            .ok()
            .and_then(|t| {
                t.get("description")
                    .and_then(|d| d.as_str().map(str::to_string))
            })
            .unwrap_or_default()
    }
}

/// "unknown profile X; did you mean Y? built-in profiles: ..." for a name that is not one.
pub fn unknown_message(name: &str) -> String {
    let names: Vec<String> = ALL.iter().map(|p| p.name.to_string()).collect();
    let mean = crate::spelling::suggestion(name, &names)
        .map(|s| format!("did you mean `{s}`? "))
        .unwrap_or_default();
    format!(
        "unknown profile `{name}`: {mean}built-in profiles are {} (pdctl profiles describes them)",
        names.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_profile_loads_and_describes_itself() {
        for p in ALL {
            let t = crate::topology::load_str(
                p.text,
                crate::topology::Source::Profile(p.name.into()),
                p.name.into(),
            )
            .unwrap_or_else(|e| panic!("profile {} does not load: {e}", p.name));
            assert_eq!(t.spec.cluster, p.name, "cluster name of profile {}", p.name);
            assert!(
                !p.description().is_empty(),
                "profile {} has no description",
                p.name
            );
        }
    }

    #[test]
    fn unknown_names_get_a_suggestion() {
        assert!(unknown_message("sim-1pd1").contains("did you mean `sim-1p1d`?"));
        assert!(get("4p4d").is_some() && get("nope").is_none());
    }
}
