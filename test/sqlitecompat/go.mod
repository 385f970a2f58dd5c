module github.com/outbox-relay/outbox-relay/test/sqlitecompat

go 1.26

require github.com/mattn/go-sqlite3 v1.13.0
