// pause: the sandbox ("pause") container of a pod for the testbed's containerd, built here
// because no registry can be pulled from. Like Kubernetes' own: it holds the pod's namespaces,
// sleeps until SIGINT or SIGTERM (then exits 0), and, as PID 1 of a shared PID namespace,
// reaps the zombies of orphaned children on SIGCHLD. Static: CGO_ENABLED=0, image FROM scratch.
package main

import (
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	if len(os.Args) > 1 {
		fmt.Fprintln(os.Stderr, "pause takes no arguments; it waits for SIGINT or SIGTERM")
		os.Exit(1)
	}
	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for sig := range signals {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var status syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
