"""The contracts between the stages: each format one stage writes and a later one reads, in one module each
(docs/ARCHITECTURE.md "The data layer"). Imports only the core; every stage may import it."""
