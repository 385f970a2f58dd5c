package config

import (
	"errors"
	"fmt"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"
)

// loadErr loads file text (if any) and environment, and returns the error,
// failing the test unless it is an *Error.
func loadErr(t *testing.T, text string, env ...string) string {
	t.Helper()
	file := ""
	if text != "" {
		file = writeFile(t, text)
	}
	_, err := load(t, file, nil, env)
	if err == nil {
		t.Fatalf("file %q, env %q: no error", text, env)
	}
	var ce *Error
	if !errors.As(err, &ce) {
		t.Fatalf("error %v is not a config.Error", err)
	}
	return err.Error()
}

// TestURLCredentialsMaskedInErrors: whatever shape a broken nats.url has,
// the error names the key and shows no password or token in it.
func TestURLCredentialsMaskedInErrors(t *testing.T) {
	for _, tc := range []struct {
		url  string
		show string // what the message still shows, to find the broken server
	}{
		{url: "u:hunter2@127.0.0.1:4222", show: "127.0.0.1:4222"},
		{url: "hunter2@127.0.0.1:4222", show: "127.0.0.1:4222"},
		{url: "nats:u:hunter2@b:4222", show: "b:4222"},
		{url: "nats:/u:hunter2@b:4222", show: "b:4222"},
		{url: "nats://a:4222,u:hunter2@b:4222", show: "b:4222"},
		{url: "nats://a:4222, nats://u:hunter2@b:4222 x", show: "b:4222 x"},
		{url: "nats://u:hunter2%zz@b:4222", show: "b:4222"},
		{url: "nats://c:4222,ws://u:hunter2%4@b:4222", show: "b:4222"},
		{url: "nats://u:hun ter2@b:4222", show: "b:4222"},
		{url: "nats://u:hunter2@b 4222", show: "b 4222"},
		{url: "nats://u:pa/hunter2@b:4222", show: "b:4222"},
		{url: "http://u:pa@hunter2@b:4222", show: "b:4222"},
		{url: "http://u:hunter2@b:4222", show: "b:4222"},
		{url: "http://hunter2@b:4222", show: "b:4222"},
		{url: "nats://u:hunter2,tail@b:4222", show: "b:4222"},
		{url: "u:hunter2", show: "nats.url"},
	} {
		t.Run(tc.url, func(t *testing.T) {
			for _, env := range []string{"NATS_URL=", "OUTBOX_RELAY_NATS_URL="} {
				msg := loadErr(t, "", env+tc.url)
				if !strings.Contains(msg, "nats.url") || !strings.Contains(msg, tc.show) {
					t.Errorf("error %q does not name nats.url and show %q", msg, tc.show)
				}
				for _, secret := range []string{"hunter2", "hun ter2", "ter2"} {
					if strings.Contains(msg, secret) {
						t.Errorf("error %q shows the credential %q", msg, secret)
					}
				}
			}
			// The error names the file, whose temporary path holds the
			// test's name: leave the path out of the search.
			file := writeFile(t, fmt.Sprintf("nats:\n  url: %q\n", tc.url))
			_, err := load(t, file, nil, nil)
			if err == nil {
				t.Fatal("no error from the file")
			}
			msg := strings.ReplaceAll(err.Error(), file, "FILE")
			if strings.Contains(msg, "hunter2") || strings.Contains(msg, "ter2") {
				t.Errorf("error from the file %q shows the credential", msg)
			}
		})
	}
}

// yamlFor returns YAML that sets the dotted key to the flow value.
func yamlFor(key, value string) string {
	parts := strings.Split(key, ".")
	var b strings.Builder
	for i, p := range parts {
		b.WriteString(strings.Repeat("  ", i) + p + ":")
		if i == len(parts)-1 {
			if value != "" {
				b.WriteString(" " + value)
			}
		}
		b.WriteString("\n")
	}
	return b.String()
}

// TestSecretsNotInErrors: a secret key given a mapping or a list, which the
// relay refuses, is named in the error but its content is not shown.
func TestSecretsNotInErrors(t *testing.T) {
	var secret []string
	for _, k := range Keys() {
		if Secret(k.Name) || k.Name == "nats.url" {
			secret = append(secret, k.Name)
		}
	}
	if len(secret) < 3 {
		t.Fatalf("secret keys %q", secret)
	}
	for _, key := range secret {
		for _, value := range []string{
			"{hunter2}",
			"{hunter2: x}",
			"{nats://u:hunter2@h:4222}",
			"[hunter2]",
			"[nats://u:hunter2@h:4222, b]",
			"\n" + strings.Repeat("  ", strings.Count(key, ".")+1) + "hunter2:",
		} {
			msg := loadErr(t, yamlFor(key, value))
			if !strings.Contains(msg, key) {
				t.Errorf("%s: %s: error %q does not name the key", key, value, msg)
			}
			if strings.Contains(msg, "hunter2") {
				t.Errorf("%s: %s: error %q shows the secret", key, value, msg)
			}
		}
	}
	// A secret set next to invalid values stays out of every message.
	msg := loadErr(t, "nats:\n  user: u\n  password: hunter2\n  token: hunter3\n", "OUTBOX_RELAY_RELAY_LEASE=1s", "OUTBOX_RELAY_NATS_MODE=x")
	if strings.Contains(msg, "hunter2") || strings.Contains(msg, "hunter3") {
		t.Errorf("error %q shows a secret", msg)
	}
}

// sectionsOf returns every section of a dotted key, outermost first:
// nats.tls.ca has nats and nats.tls.
func sectionsOf(key string) []string {
	var out []string
	for i, c := range key {
		if c == '.' {
			out = append(out, key[:i])
		}
	}
	return out
}

// envValue formats a default as an environment variable's value.
func envValue(v any) string {
	switch d := v.(type) {
	case string:
		return d
	case int:
		return strconv.Itoa(d)
	case bool:
		return strconv.FormatBool(d)
	case time.Duration:
		return d.String()
	case []string:
		return strings.Join(d, ",")
	}
	panic(fmt.Sprintf("no env form for %T", v))
}

// TestEmptySectionKeepsDefaults: a section written with nothing under it
// (YAML null) changes nothing, also when the environment or a flag sets a
// key of that section.
func TestEmptySectionKeepsDefaults(t *testing.T) {
	for _, k := range Keys() {
		for _, section := range sectionsOf(k.Name) {
			file := writeFile(t, yamlFor(section, ""))
			val := envValue(k.Default)
			if val == "" {
				continue // an empty variable counts as unset
			}
			for name, load := range map[string]func() (Config, error){
				"file only": func() (Config, error) { return load(t, file, nil, nil) },
				"env":       func() (Config, error) { return load(t, file, nil, []string{k.Env + "=" + val}) },
				"flag":      func() (Config, error) { return load(t, file, flags(t, "--"+k.Flag+"="+val), nil) },
			} {
				c, err := load()
				if err != nil {
					t.Errorf("%s: empty section %s with %s set to its default (%s): %v", name, section, k.Name, val, err)
					continue
				}
				if c.NATS.Sources = nil; !reflect.DeepEqual(c, Default()) {
					t.Errorf("%s: empty section %s with %s set to its default: got %+v, want the defaults", name, section, k.Name, c)
				}
			}
		}
	}
	// "database: ~" and "database: null" are the same empty section.
	for _, text := range []string{"database: ~\n", "database: null\n", "Database:\n"} {
		c, err := load(t, writeFile(t, text), nil, []string{"OUTBOX_RELAY_DATABASE_TABLE=outbox"})
		if err != nil || c.Database.Path != "app.db" || c.Database.Table != "outbox" || c.Database.BusyTimeout != 5*time.Second {
			t.Errorf("%q: %+v, %v", text, c.Database, err)
		}
	}
	// A section given a single value is an error naming it.
	if msg := loadErr(t, "database: app.db\n"); !strings.Contains(msg, "database:") || strings.Contains(msg, "unknown") {
		t.Errorf("error %q does not say that database is a section", msg)
	}
}

// TestIntegerKeysStrict: an integer key refuses a fraction, a boolean and a
// number out of range, naming the key and the value as written.
func TestIntegerKeysStrict(t *testing.T) {
	for _, tc := range []struct {
		file string
		env  string
		want []string
	}{
		{file: "relay:\n  batch_size: 1.5\n", want: []string{"relay.batch_size", "1.5", "not an integer"}},
		{env: "OUTBOX_RELAY_RELAY_BATCH_SIZE=1.5", want: []string{"relay.batch_size", "1.5", "not an integer"}},
		{file: "relay:\n  max_attempts: 3.0\n", want: []string{"relay.max_attempts", "3.0", "not an integer"}},
		{file: "relay:\n  batch_size: 1e3\n", want: []string{"relay.batch_size", "1e3", "not an integer"}},
		{file: "relay:\n  batch_size: true\n", want: []string{"relay.batch_size", "true", "not an integer"}},
		{file: "relay:\n  batch_size: 99999999999999999999\n", want: []string{"relay.batch_size", "99999999999999999999", "out of range"}},
		{file: "relay:\n  batch_size: 18446744073709551615\n", want: []string{"relay.batch_size", "18446744073709551615", "out of range"}},
		{file: "relay:\n  batch_size: -99999999999999999999\n", want: []string{"relay.batch_size", "-99999999999999999999", "out of range"}},
		{file: "stream:\n  replicas: 9223372036854775808\n", want: []string{"stream.replicas", "9223372036854775808", "out of range"}},
		{env: "OUTBOX_RELAY_RELAY_BATCH_SIZE=99999999999999999999", want: []string{"relay.batch_size", "99999999999999999999", "out of range"}},
		{env: "EVENT_QUEUE_MAX_ATTEMPTS=99999999999999999999", want: []string{"relay.max_attempts", "99999999999999999999", "out of range"}},
	} {
		msg := loadErr(t, tc.file, tc.env)
		for _, w := range tc.want {
			if !strings.Contains(msg, w) {
				t.Errorf("file %q env %q: error %q does not say %q", tc.file, tc.env, msg, w)
			}
		}
		if strings.Contains(msg, "must be at least") {
			t.Errorf("error %q reports a wrapped-around number", msg)
		}
	}
	// Integers as YAML writes them still load, in base 10 ("010" is ten).
	c, err := load(t, writeFile(t, "relay:\n  batch_size: 500\n  max_in_flight: \"600\"\n  max_attempts: 010\nstream:\n  replicas: +3\n"), nil, nil)
	if err != nil || c.Relay.BatchSize != 500 || c.Relay.MaxInFlight != 600 || c.Relay.MaxAttempts != 10 || c.Stream.Replicas != 3 {
		t.Fatalf("integers: %+v %d, %v", c.Relay, c.Stream.Replicas, err)
	}
}

// TestTableNotSQLKeyword: the table name goes into SQL unquoted, so an SQL
// keyword is refused in any case, with the key and the reason.
func TestTableNotSQLKeyword(t *testing.T) {
	for _, name := range []string{"select", "SELECT", "Table", "order", "group", "index", "values", "temp", "returning"} {
		for _, msg := range []string{
			loadErr(t, "", "OUTBOX_RELAY_DATABASE_TABLE="+name),
			loadErr(t, "database:\n  table: "+name+"\n"),
		} {
			if !strings.Contains(msg, "database.table") || !strings.Contains(msg, strconv.Quote(name)) || !strings.Contains(msg, "keyword") {
				t.Errorf("table %s: error %q does not name database.table and say it is a keyword", name, msg)
			}
		}
	}
	for _, name := range []string{"event_queue", "selected", "outbox", "events", "orders"} {
		if _, err := load(t, "", nil, []string{"OUTBOX_RELAY_DATABASE_TABLE=" + name}); err != nil {
			t.Errorf("table %s: %v", name, err)
		}
	}
}

// otherValue returns a value other than the key's default, in the form a
// variable or a flag takes.
func otherValue(k Key) string {
	switch d := k.Default.(type) {
	case string:
		return "other"
	case int:
		return strconv.Itoa(d + 7)
	case bool:
		return strconv.FormatBool(!d)
	case time.Duration:
		return (d + 3*time.Second).String()
	case []string:
		return "a.>,b.>"
	}
	panic(fmt.Sprintf("no other value for %T", k.Default))
}

// TestEveryKeyFromEnvAndFlag: each key's variable, its alias and its flag
// all reach the key, and give the same result; flags left at their default
// change nothing, whatever their type.
func TestEveryKeyFromEnvAndFlag(t *testing.T) {
	defaults := fmt.Sprintf("%+v", Default())
	for _, k := range Keys() {
		// The values, and errors with the name of the source left out:
		// each source gives the same, and says it was the source.
		source := []string{"--" + k.Flag, "SOURCE", k.Env, "SOURCE"}
		if k.Alias != "" {
			source = append(source, "("+k.Alias+")", "(SOURCE)")
		}
		result := func(c Config, err error) string {
			if err != nil {
				return strings.NewReplacer(source...).Replace(err.Error())
			}
			c.NATS.Sources = nil
			return fmt.Sprintf("%+v", c)
		}
		val := otherValue(k)
		want := result(load(t, "", flags(t, "--"+k.Flag+"="+val), nil))
		if want == defaults {
			t.Errorf("%s: the flag set to %s changes nothing", k.Name, val)
		}
		names := []string{k.Env}
		// NATS_USER alone is a token, as natscli reads it: see
		// TestNatscliUserIsTokenWithoutPassword.
		if k.Alias != "" && k.Alias != "NATS_USER" {
			names = append(names, k.Alias)
		}
		for _, name := range names {
			env := []string{name + "=" + val}
			if got := result(load(t, "", nil, env)); got != want {
				t.Errorf("%s=%s: %s\nthe flag gives %s", name, val, got, want)
			}
			if got := result(load(t, "", flags(t), env)); got != want {
				t.Errorf("%s=%s with every flag at its default: %s\nwant %s", name, val, got, want)
			}
		}
		file := writeFile(t, yamlFor(k.Name, strconv.Quote(val)))
		if k.Type.Kind() == reflect.Slice {
			file = writeFile(t, yamlFor(k.Name, "[a.>, b.>]"))
		}
		if want, got := result(load(t, file, nil, nil)), result(load(t, file, flags(t), nil)); got != want {
			t.Errorf("%s in the file with every flag at its default: %s\nwant %s", k.Name, got, want)
		}
	}
}

// TestURLUserinfoNeedsPercentEncoding: a user or password with a raw '/',
// '#', '?', ' ', '%' or ',' in nats.url is refused with the character and
// its percent-encoding, never with the password; a '#' after digits, which
// url.Parse reads as a host and port, too.
func TestURLUserinfoNeedsPercentEncoding(t *testing.T) {
	for _, tc := range []struct {
		url, char, code string
	}{
		{"nats://relay:pa/ss-hunter2@127.0.0.1:4222", `'/'`, "%2F"},
		{"nats://relay:pa#ss-hunter2@127.0.0.1:4222", `'#'`, "%23"},
		{"nats://relay:12#34hunter2@127.0.0.1:4222", `'#'`, "%23"},
		{"tls://relay:pa?ss-hunter2@h:4222", `'?'`, "%3F"},
		{"nats://relay:pa ss-hunter2@h:4222", `' '`, "%20"},
		{"nats://relay:100%hunter2@h:4222", `'%'`, "%25"},
		{"nats://re/lay:hunter2@h:4222", `'/'`, "%2F"},
		{"nats://relay:pa,ss-hunter2@h:4222", `','`, "%2C"},
		{"nats://a:4222,nats://relay:pa/ss-hunter2@h:4222", `'/'`, "%2F"},
	} {
		msg := loadErr(t, "", "NATS_URL="+tc.url)
		for _, want := range []string{"nats.url", tc.char, "percent-encode", tc.code} {
			if !strings.Contains(msg, want) {
				t.Errorf("%s: error %q does not say %s", tc.url, msg, want)
			}
		}
		if strings.Contains(msg, "hunter2") {
			t.Errorf("%s: error %q shows the password", tc.url, msg)
		}
	}
	// Percent-encoded, they load; and '@' or ':' in a password need nothing.
	for _, u := range []string{"nats://relay:pa%2Fss%23x%3F%20%25%2C@h:4222", "nats://relay:p@ss:w@h:4222"} {
		if _, err := load(t, "", nil, []string{"NATS_URL=" + u}); err != nil {
			t.Errorf("%s: %v", u, err)
		}
	}
}
