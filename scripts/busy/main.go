// Command busy keeps every core busy until it is killed or its -for
// passes: the load under which scripts/loaded-tests.sh runs the suite.
package main

import (
	"flag"
	"runtime"
	"time"
)

func main() {
	d := flag.Duration("for", time.Hour, "how long to spin at most")
	flag.Parse()
	for range runtime.NumCPU() {
		go func() {
			for n := 0; ; n++ {
				_ = n * n
			}
		}()
	}
	time.Sleep(*d)
}
