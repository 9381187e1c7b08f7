//! Built-in profiles.
