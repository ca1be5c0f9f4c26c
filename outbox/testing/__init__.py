"""Test aids shipped with the package: the fault-injection and no-op sinks (``sinks``) and the
sink conformance suite (``conformance``, which needs pytest). Importing this package loads
neither, so an installation without pytest can still use the sinks."""
