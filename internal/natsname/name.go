package natsname

import "regexp"

var nameRe = regexp.MustCompile(`^[^\s.*>/\\]+$`)

// ValidName reports whether s can name a stream or a consumer: not empty,
// and none of the characters JetStream does not allow in one (whitespace,
// '.', '*', '>', '/' and '\').
func ValidName(s string) bool { return nameRe.MatchString(s) }
