package config

import (
	"fmt"
	"maps"
	"os"
	"reflect"
	"slices"
	"sort"
	"strings"

	"github.com/spf13/pflag"
	"github.com/spf13/viper"
	"go.yaml.in/yaml/v3"

	"github.com/outbox-relay/outbox-relay/internal/fleet"
	"github.com/outbox-relay/outbox-relay/internal/natsname"
)

// Error is a configuration error; the command line turns it into exit code 2.
type Error struct{ Err error }

// Error returns the message of the error it wraps.
func (e *Error) Error() string { return e.Err.Error() }

// Unwrap returns the error it wraps.
func (e *Error) Unwrap() error { return e.Err }

func configErr(format string, args ...any) error {
	return &Error{Err: fmt.Errorf(format, args...)}
}

// Load reads the configuration: defaults, then the natscli context named by
// nats.context (if any), then the YAML file (if file is not empty), then the
// process environment, then the flags in fs that were set on the command
// line (fs may be nil). A stream.subject_template left empty or unset
// is the default for database.path (see defaultSubjectTemplate). The
// result is validated. Every error is an *Error naming the key.
//
// Each source is a layer of viper's own: defaults, the file (merged as a
// map, see readFile), the environment variables bound to each key and the
// flags bound to each key, which viper only takes when they were set on the
// command line. A few rules viper has no setting for are kept here: an
// unknown OUTBOX_RELAY_* variable is an error, an empty variable sets the
// keys of emptyMeans, and the natscli context fills only what the other
// sources leave empty (see applyContext).
func Load(file string, fs *pflag.FlagSet) (Config, error) {
	v := viper.New()
	keys := Keys()
	known := map[string]bool{}
	for _, k := range keys {
		known[k.Name] = true
		v.SetDefault(k.Name, k.Default)
	}
	if file != "" {
		m, written, err := readFile(file)
		if err != nil {
			return Config{}, err
		}
		if err := v.MergeConfigMap(m); err != nil {
			return Config{}, configErr("read config file %s: %w", file, err)
		}
		// Before the environment and flags are bound: viper lists a bound
		// key in AllKeys and would then hide the file's keys under it
		// (nats.password.x under nats.password).
		if err := checkFileKeys(v, known, written, file); err != nil {
			return Config{}, err
		}
	}
	if err := checkEnv(keys); err != nil {
		return Config{}, err
	}
	changed, err := bindFlags(v, fs, keys)
	if err != nil {
		return Config{}, err
	}
	userIsToken := bindEnv(v, keys, changed)
	setEmptyEnv(v, keys, changed)
	src := sourcer{v: v, file: file, changed: changed, userIsToken: userIsToken}
	if src.ctx, err = applyContext(v, src.of); err != nil {
		return Config{}, err
	}
	c, err := decode(v)
	if err != nil {
		return Config{}, err
	}
	c.NATS.Sources = src.sources()
	if c.Stream.SubjectTemplate == "" || src.of("stream.subject_template") == "" {
		c.Stream.SubjectTemplate = defaultSubjectTemplate(c.Database.Path)
	}
	if err := c.Validate(); err != nil {
		return Config{}, &Error{Err: err}
	}
	return c, nil
}

// defaultSubjectTemplate is stream.subject_template's default for
// database.path: a fleet's files (a pattern) each on their tenant's
// subjects (natsname.FleetTemplate), so that a file's reconciliation reads
// its own tenant's messages alone; one file's the event type alone.
func defaultSubjectTemplate(path string) string {
	if fleet.IsPattern(path) {
		return natsname.FleetTemplate
	}
	return natsname.EventTypeToken
}

// readFile reads the YAML file for viper. A section written with nothing
// under it (YAML null) is left out, as if absent: viper would otherwise take
// the null for the whole section and, once the environment or a flag sets
// one of its keys, lose the defaults of the others. An integer key keeps its
// text as written, so that the decoder can refuse 1.5 and report
// 99999999999999999999 as it stands instead of a float's wrapped-around
// conversion. It also returns each dotted key of the file as written, by
// its lowercased form (viper's), so that errors can show the user's own
// spelling (relay.batchSize, not relay.batchsize).
func readFile(file string) (map[string]any, map[string]string, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, nil, configErr("read config file %s: %w", file, err)
	}
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil {
		return nil, nil, configErr("read config file %s: %s", file, oneLine(err.Error()))
	}
	m := map[string]any{}
	if len(doc.Content) == 0 {
		return m, nil, nil // empty file
	}
	root := doc.Content[0]
	if isNull(root) {
		return m, nil, nil
	}
	if root.Kind != yaml.MappingNode {
		return nil, nil, configErr("read config file %s: the top level must be sections such as database: and nats:", file)
	}
	if err := root.Decode(&m); err != nil {
		return nil, nil, configErr("read config file %s: %s", file, oneLine(err.Error()))
	}
	ints := map[string]bool{}
	for _, k := range Keys() {
		if k.Type.Kind() == reflect.Int {
			ints[k.Name] = true
		}
	}
	prepareFile(root, m, "", sections(), ints)
	written := map[string]string{}
	writtenKeys(root, "", written)
	return m, written, nil
}

// prepareFile drops the null sections of the mapping node and its decoded
// form m, and puts back the text of integer keys (see readFile).
func prepareFile(node *yaml.Node, m map[string]any, prefix string, sections, ints map[string]bool) {
	for i := 0; i+1 < len(node.Content); i += 2 {
		key, val := node.Content[i], node.Content[i+1]
		if val.Kind == yaml.AliasNode && val.Alias != nil {
			val = val.Alias
		}
		name := prefix + strings.ToLower(key.Value)
		switch {
		case sections[name] && isNull(val):
			delete(m, key.Value)
		case sections[name] && val.Kind == yaml.MappingNode:
			if sub, ok := m[key.Value].(map[string]any); ok {
				prepareFile(val, sub, name+".", sections, ints)
			}
		case ints[name] && val.Kind == yaml.ScalarNode && !isNull(val):
			m[key.Value] = val.Value
		}
	}
}

func isNull(n *yaml.Node) bool {
	return n.Kind == yaml.ScalarNode && n.ShortTag() == "!!null"
}

// checkFileKeys refuses keys of the file that are not configuration keys,
// each shown as written with the nearest known key when one is close, and
// values of the wrong shape: keys under a key that takes a value (not
// shown: under nats.password they could be the password), a value where a
// section belongs.
func checkFileKeys(v *viper.Viper, known map[string]bool, written map[string]string, file string) error {
	secs := sections()
	var msgs []string
	shape := map[string]string{}
	for _, k := range v.AllKeys() {
		if known[k] || !v.InConfig(k) {
			continue
		}
		if secs[k] {
			shape[k] = fmt.Sprintf("%s: must be a section with keys under it, not a single value (in %s)", k, file)
			continue
		}
		if leaf := knownPrefix(k, known); leaf != "" {
			shape[leaf] = fmt.Sprintf("%s: takes a value, not keys under it (in %s)", leaf, file)
			continue
		}
		name := k
		if w := written[k]; w != "" {
			name = w
		}
		msg := fmt.Sprintf("unknown config key %s in %s", name, file)
		if near := nearestKey(name, known); near != "" {
			msg += fmt.Sprintf(" (did you mean %s?)", near)
		}
		msgs = append(msgs, msg)
	}
	sort.Strings(msgs)
	for _, k := range slices.Sorted(maps.Keys(shape)) {
		msgs = append(msgs, shape[k])
	}
	if len(msgs) > 0 {
		return configErr("%s", strings.Join(msgs, "; "))
	}
	return nil
}

// knownPrefix returns the configuration key that the dotted name k lies
// under (nats.password for nats.password.x), or "".
func knownPrefix(k string, known map[string]bool) string {
	for i := strings.LastIndex(k, "."); i > 0; i = strings.LastIndex(k[:i], ".") {
		if known[k[:i]] {
			return k[:i]
		}
	}
	return ""
}
