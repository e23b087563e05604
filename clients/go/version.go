package engine

// Version is this SDK's version. It moves together with the engine.v1 contract and the other SDKs (see
// docs/versioning.md): the same MAJOR.MINOR means the same contract.
const Version = "0.1.0"

// APIVersion is the contract package this SDK speaks.
const APIVersion = "engine.v1"
