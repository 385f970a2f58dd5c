package config

import (
	"errors"
	"fmt"
	"math"
	"reflect"
	"strconv"
	"strings"
	"time"

	"github.com/go-viper/mapstructure/v2"
	"github.com/spf13/viper"
)

// decode fills a Config from v, refusing keys that are no field's, with
// the strict hooks below; an error is an *Error of one line.
func decode(v *viper.Viper) (Config, error) {
	var c Config
	err := v.UnmarshalExact(&c, viper.DecodeHook(mapstructure.ComposeDecodeHookFunc(
		strictDurationHook,
		strictIntHook,
		mapstructure.StringToTimeDurationHookFunc(),
		mapstructure.StringToSliceHookFunc(","),
	)))
	if err != nil {
		return Config{}, configErr("%s", decodeMessage(err))
	}
	return c, nil
}

var durationType = reflect.TypeOf(time.Duration(0))

// strictDurationHook refuses bare numbers for durations: YAML "lease: 600"
// would otherwise decode as 600 nanoseconds.
func strictDurationHook(from, to reflect.Type, data any) (any, error) {
	if to != durationType {
		return data, nil
	}
	switch from.Kind() {
	case reflect.String:
		s := data.(string)
		if _, err := time.ParseDuration(s); err != nil {
			return nil, fmt.Errorf("%q is not a duration (use a unit: 250ms, 30s, 1h)", s)
		}
		return data, nil
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64,
		reflect.Float32, reflect.Float64:
		if from == durationType {
			return data, nil
		}
		return nil, fmt.Errorf("%v has no unit (use a duration such as 250ms, 30s, 1h)", data)
	}
	return data, nil
}

var intType = reflect.TypeOf(0)

// strictIntHook refuses what is not an integer as written (1.5, 1e3, true)
// and reports a number out of range as it was written: the decoder would
// truncate the one and wrap the other around to a negative number.
func strictIntHook(from, to reflect.Type, data any) (any, error) {
	if to != intType {
		return data, nil
	}
	v := reflect.ValueOf(data)
	switch from.Kind() {
	case reflect.String:
		s := v.String()
		// Base 10 only: "010" is ten to an operator, not eight.
		n, err := strconv.ParseInt(strings.TrimPrefix(s, "+"), 10, strconv.IntSize)
		switch {
		case errors.Is(err, strconv.ErrRange) && strings.HasPrefix(s, "-"):
			return nil, fmt.Errorf("%s is out of range (at least %d)", s, math.MinInt)
		case errors.Is(err, strconv.ErrRange):
			return nil, fmt.Errorf("%s is out of range (at most %d)", s, math.MaxInt)
		case err != nil:
			return nil, fmt.Errorf("%q is not an integer", s)
		}
		return int(n), nil
	case reflect.Float32, reflect.Float64:
		f := v.Float()
		switch {
		case f != math.Trunc(f) || math.IsInf(f, 0):
			return nil, fmt.Errorf("%v is not an integer", data)
		case f < math.MinInt || f >= math.MaxInt:
			return nil, fmt.Errorf("%v is out of range (between %d and %d)", data, math.MinInt, math.MaxInt)
		}
		return int(f), nil
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64, reflect.Uintptr:
		if v.Uint() > math.MaxInt {
			return nil, fmt.Errorf("%d is out of range (at most %d)", v.Uint(), math.MaxInt)
		}
		return int(v.Uint()), nil
	case reflect.Bool:
		return nil, fmt.Errorf("%v is not an integer", data)
	}
	return data, nil
}

// decodeMessage turns mapstructure's errors into one line of
// "key: what is wrong". The value of a key that holds a secret (or a URL,
// which may hold one) is never shown.
func decodeMessage(err error) string {
	var parts []string
	var walk func(err error)
	walk = func(err error) {
		// Descend through joins, nested decode errors and the wrapper
		// mapstructure puts around several errors.
		var inner error
		switch e := err.(type) {
		case interface{ Unwrap() []error }:
			for _, x := range e.Unwrap() {
				walk(x)
			}
			return
		case *mapstructure.DecodeError:
			inner = e.Unwrap()
		default:
			inner = errors.Unwrap(err)
		}
		switch inner.(type) {
		case *mapstructure.DecodeError, interface{ Unwrap() []error }:
			walk(inner)
			return
		}
		de, ok := err.(*mapstructure.DecodeError)
		switch {
		case !ok:
			parts = append(parts, oneLine(err.Error()))
		case de.Name() == "nats.url":
			parts = append(parts, "nats.url: must be a string (servers separated by commas)")
		case Secret(de.Name()):
			parts = append(parts, de.Name()+": must be a string")
		case inner == nil:
			parts = append(parts, oneLine(err.Error()))
		default:
			parts = append(parts, de.Name()+": "+oneLine(inner.Error()))
		}
	}
	walk(err)
	return strings.Join(parts, "; ")
}

// oneLine joins the lines of a message with "; ".
func oneLine(msg string) string {
	var parts []string
	for _, line := range strings.Split(msg, "\n") {
		if line = strings.TrimSpace(line); line != "" {
			parts = append(parts, strings.TrimPrefix(line, "* "))
		}
	}
	return strings.Join(parts, "; ")
}
