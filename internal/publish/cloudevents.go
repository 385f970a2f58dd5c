package publish

import (
	"fmt"
	"maps"
	"net/url"
	"slices"
	"strings"
)

// The CloudEvents binary-mode headers the relay sets.
const (
	HeaderCESpecVersion = "ce-specversion"
	HeaderCEID          = "ce-id"
	HeaderCEType        = "ce-type"
	HeaderCESource      = "ce-source"
	HeaderCETime        = "ce-time"
	HeaderContentType   = "content-type"
)

// Reserved lists the header names the format sets, which a row's own
// headers may not.
func (f Format) Reserved() []string {
	if !f.CloudEvents {
		return nil
	}
	names := []string{HeaderCESpecVersion, HeaderCEID, HeaderCEType, HeaderCESource, HeaderCETime}
	if f.ContentType != "" {
		names = append(names, HeaderContentType)
	}
	return names
}

// CheckHeaders reports why a row's headers h cannot go on a message of this
// format: in CloudEvents format, a ce- header is a CloudEvents attribute,
// which CloudEvents SDKs refuse to read (the whole message with it) when
// its name is not letters and digits, or when the dataschema attribute is
// not an absolute URI. ce-datacontenttype is refused too: in binary mode
// the data's content type is the content-type header, and an SDK would
// read one or the other at random.
func (f Format) CheckHeaders(h map[string][]string) error {
	if !f.CloudEvents {
		return nil
	}
	for _, name := range slices.Sorted(maps.Keys(h)) { // the first bad one, always the same
		if len(name) < 3 || !strings.EqualFold(name[:3], "ce-") {
			continue
		}
		attr := strings.ToLower(name[3:])
		if attr == "" || strings.Trim(attr, "abcdefghijklmnopqrstuvwxyz0123456789") != "" {
			return fmt.Errorf("headers: header name %q is not a CloudEvents attribute: a ce- header names one, in letters and digits only, and CloudEvents SDKs refuse the message; rename the header, for example to X-%s", name, name[3:])
		}
		switch attr {
		case "datacontenttype":
			return fmt.Errorf("headers: header name %q is reserved: in CloudEvents binary mode the data's content type is the content-type header (message.content_type)", name)
		case "dataschema":
			for _, v := range h[name] {
				if u, err := url.Parse(v); err != nil || !u.IsAbs() {
					return fmt.Errorf("headers: %s: value %q is not an absolute URI, which the dataschema attribute must be", name, v)
				}
			}
		}
	}
	return nil
}
