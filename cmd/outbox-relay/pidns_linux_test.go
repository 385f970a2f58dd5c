package main

import (
	"os"
	"os/exec"
	"strconv"
	"syscall"
	"testing"
)

// inOwnPIDNamespace makes cmd start in a pid namespace of its own: it sees
// no other process, and no other relay sees it, as in a container of its
// own or on another host.
func inOwnPIDNamespace(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID}
}

// ownPIDNamespaceAllowed says why a process cannot be started in a pid
// namespace of its own (it takes CAP_SYS_ADMIN), or nil.
func ownPIDNamespaceAllowed() error {
	cmd := exec.Command("/bin/true")
	inOwnPIDNamespace(cmd)
	return cmd.Run()
}

// pidNamespace returns the pid namespace of the process pid, as
// /proc/PID/ns/pid names it ("pid:[4026531836]").
func pidNamespace(t *testing.T, pid int) string {
	t.Helper()
	ns, err := os.Readlink("/proc/" + strconv.Itoa(pid) + "/ns/pid")
	if err != nil {
		t.Fatal(err)
	}
	return ns
}
