"""The ways people and agents reach the outbox: the command line, the dashboard, the MCP
server, the Prometheus endpoint and the demo. Each shapes what the façade returns; none
holds a use case of its own."""
