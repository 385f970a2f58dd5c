package schema_test

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/sqlitedb"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// documentedDDL is the SQL docs/contract.md gives applications that create
// the tables in their own migrations: the first sql block after its
// heading.
func documentedDDL(t *testing.T) string {
	t.Helper()
	doc, err := os.ReadFile("../../docs/contract.md")
	if err != nil {
		t.Fatal(err)
	}
	const heading = "### Creating the tables in your own migrations"
	_, section, ok := strings.Cut(string(doc), "\n"+heading+"\n")
	if !ok {
		t.Fatalf("docs/contract.md has no heading %q", heading)
	}
	_, block, ok := strings.Cut(section, "\n```sql\n")
	if !ok {
		t.Fatalf("no sql block after %q in docs/contract.md", heading)
	}
	ddl, _, ok := strings.Cut(block, "\n```")
	if !ok {
		t.Fatal("the sql block in docs/contract.md does not end")
	}
	return ddl
}

// schemaOf describes what the relay needs of a file's schema in the terms
// SQLite reports: each table's columns (name, declared type, NOT NULL,
// default, primary key) and each index's definition, outbox_relay_migrations
// aside (the relay's own record, which verify does not need).
func schemaOf(t *testing.T, s *sqlitedb.DB) []string {
	t.Helper()
	var out []string
	rows, err := s.Reader().Query(`SELECT m.type, m.name, coalesce(m.sql, ''),
		coalesce((SELECT group_concat(c.name || ' ' || c.type || ' ' || c."notnull" || ' ' || coalesce(c.dflt_value, 'NULL') || ' ' || c.pk, ', ')
			FROM pragma_table_info(m.name) AS c), '')
		FROM sqlite_master AS m WHERE m.name <> ? ORDER BY m.type, m.name`, schema.MigrationsTable)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var typ, name, def, cols string
		if err := rows.Scan(&typ, &name, &def, &cols); err != nil {
			t.Fatal(err)
		}
		switch {
		case typ == "table":
			out = append(out, fmt.Sprintf("table %s (%s)", name, cols))
		case strings.HasPrefix(name, "sqlite_autoindex_"+schema.MigrationsTable):
		default:
			out = append(out, fmt.Sprintf("%s %s: %s", typ, name, def))
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestDocumentedSchema: the CREATE statements docs/contract.md gives
// applications that manage the schema themselves make the schema the
// relay's migrations make, column for column and index for index, which
// verify accepts, also under another table name; migrating such a file
// later changes nothing.
func TestDocumentedSchema(t *testing.T) {
	ctx := context.Background()
	ddl := documentedDDL(t)
	want := schemaOf(t, testenv.MigratedDB(t))
	for _, table := range []string{"event_queue", "orders_outbox"} {
		t.Run(table, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "app.db")
			app, err := sql.Open("sqlite3", "file:"+path)
			if err != nil {
				t.Fatal(err)
			}
			defer app.Close()
			if _, err := app.Exec(strings.ReplaceAll(ddl, "event_queue", table)); err != nil {
				t.Fatalf("the documented DDL: %v", err)
			}
			s, err := sqlitedb.Open(ctx, sqlitedb.Options{Path: path, Table: table})
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			if err := schema.Verify(ctx, s); err != nil {
				t.Fatalf("verify on the documented DDL: %v", err)
			}
			if table != "event_queue" {
				return
			}
			got := schemaOf(t, s)
			if !reflect.DeepEqual(got, want) {
				t.Errorf("the documented DDL makes\n%s\nthe migrations make\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
			}
			if _, err := schema.Migrate(ctx, s); err != nil {
				t.Fatalf("migrate after the documented DDL: %v", err)
			}
			if after := schemaOf(t, s); !reflect.DeepEqual(after, got) {
				t.Errorf("migrate changed the documented schema: now\n%s", strings.Join(after, "\n"))
			}
		})
	}
}
