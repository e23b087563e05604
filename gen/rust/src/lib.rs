//! Generated prost messages and tonic stubs of the `engine.v1` gRPC contract.
//!
//! The code under `generated/` is produced by `scripts/generate.sh`; do not edit it by hand.
#![allow(clippy::all, clippy::pedantic, rustdoc::all)]

/// The `engine` proto package family.
pub mod engine {
    /// Version 1 of the contract (proto package `engine.v1`).
    pub mod v1 {
        include!("generated/engine/v1/engine.v1.rs");
    }
}
